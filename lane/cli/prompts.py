"""A run's prompts (ids, text through the model's tokenizer, a --prompts file) and a batch run's line a prompt: what
`run` (lane/cli/commands.py) and `run --ranks R` (lane/cli/ranks.py) share, in a module of its own so neither imports
the other."""

from __future__ import annotations

import json
import os
import sys

from lanefuse.engine.errors import UserError, clip

BATCH_CAP = 64  # the default slots at most (--batch gives more, up to the step's MAX_BATCH)


def _tokenizer(src, what: str = "--prompt"):
    """The model's tokenizer: a GGUF file's, from its metadata, or a folder's tokenizer.json."""
    if getattr(src, "tokenizer", None) is not None:
        return src.tokenizer()
    if not src.path or not os.path.isdir(src.path) or not os.path.exists(os.path.join(src.path, "tokenizer.json")):
        raise UserError(f"{what} needs a checkpoint folder with tokenizer.json or a GGUF file holding a tokenizer "
                        f"(use --prompt-ids for the demo)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(f"{what} needs the `tokenizers` package (pip install tokenizers)") from None
    return Tokenizer.from_file(os.path.join(src.path, "tokenizer.json"))


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--prompt-ids {text[:40]!r}: expected comma-separated integers, e.g. 1,2,3") from None
    if not ids:
        raise UserError(f"--prompt-ids {text[:40]!r}: no token ids; give at least one, e.g. 1,2,3")
    return ids


def _in_vocab(src, ids: list[int], what: str = "prompt ids") -> None:
    vocab = src.cfg.vocab if src.cfg else None
    if vocab is not None:
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise UserError(f"{what} {clip(bad[:5], 120)} are outside the vocabulary (0..{vocab - 1})")


def _encode(args, src, tok, text: str) -> list[int]:
    """Prompt text as ids: as it is, or (--chat) put through the model's chat template as one user message, its
    control tokens as themselves and nothing added (the template writes the BOS it wants)."""
    if not getattr(args, "chat", False):
        return tok.encode(text).ids
    if getattr(src, "chat", None) is None:
        raise UserError(f"--chat: {src.name} is no GGUF file; the chat template is read from a GGUF file's "
                        f"`tokenizer.chat_template`")
    return tok.encode(src.chat(text), add_special_tokens=False).ids


def _prompt_ids(args, src) -> tuple[list[int], object | None]:
    if args.prompt_ids is not None and args.prompt is not None:
        raise UserError("give --prompt-ids or --prompt, not both")
    tok = None
    if args.prompt is not None:
        tok = _tokenizer(src)
        ids = _encode(args, src, tok, args.prompt)
    elif getattr(args, "chat", False) and not getattr(args, "prompts", None):
        raise UserError("--chat puts --prompt TEXT through the chat template: give --prompt")
    elif args.prompt_ids is not None:
        ids = _parse_ids(args.prompt_ids[0])
    else:
        ids = [1]
    if not ids:
        raise UserError("the prompt is empty")
    _in_vocab(src, ids)
    return ids, tok


MAX_PROMPT_LINE = 4 << 20  # characters a line of a --prompts file (a prompt of 500k ids, or of text, fits)


def _batch_prompts(args, src) -> tuple[list[list[int]], object | None]:
    """A batch's prompts in the order given: each --prompt-ids, then each line of --prompts FILE (a JSON list of ids,
    or {"prompt": text}); a bad line is named by its number."""
    if args.prompt is not None:
        raise UserError("a batch takes --prompt-ids (repeatable) or --prompts FILE; put a text prompt in the file as "
                        "{\"prompt\": TEXT}")
    prompts = [_parse_ids(t) for t in args.prompt_ids or ()]
    tok = None
    if args.prompts:
        from lanefuse.engine import userfile
        from lanefuse.engine.yamlsafe import read_text

        text = read_text(args.prompts, what="a --prompts file", cap=userfile.MAX_PROMPTS, pipes=True)  # `<(cmd)` too
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{args.prompts}:{n}"
            if len(line) > MAX_PROMPT_LINE:
                raise UserError(f"{where}: a line of {len(line)} characters; a prompt line holds at most "
                                f"{MAX_PROMPT_LINE}")
            try:
                doc = json.loads(line)
            except RecursionError:
                raise UserError(f"{where}: nested too deep; a line is a list of ids or {{\"prompt\": TEXT}}") from None
            except ValueError as e:  # not JSON, or an integer of more digits than Python converts
                why = e.msg if isinstance(e, json.JSONDecodeError) else clip(e, 80)
                raise UserError(f"{where}: not JSON ({why}); a line is a list of ids or {{\"prompt\": TEXT}}") from None
            if isinstance(doc, dict) and set(doc) == {"prompt"} and isinstance(doc["prompt"], str):
                tok = tok or _tokenizer(src, f"{where}: a text prompt")
                ids = _encode(args, src, tok, doc["prompt"])
            elif isinstance(doc, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in doc):
                ids = list(doc)
            else:
                raise UserError(f"{where}: a line is a JSON list of token ids or {{\"prompt\": TEXT}}")
            if not ids:
                raise UserError(f"{where}: the prompt is empty")
            _in_vocab(src, ids, f"{where}: prompt ids")
            prompts.append(ids)
        if not prompts:
            raise UserError(f"--prompts {args.prompts}: no prompts in the file (one a line)")
    for ids in prompts:
        _in_vocab(src, ids)
    return prompts, tok


def batch_slots(args, prompts) -> int:
    """The slots of a batch run: --batch, else every prompt up to BATCH_CAP; more than a batch step holds refused."""
    from lanefuse.engine.ir import MAX_BATCH

    slots = args.batch or min(len(prompts), BATCH_CAP)
    if slots > MAX_BATCH:
        raise UserError(f"--batch {slots}: a batch step decodes at most {MAX_BATCH} sequences")
    return slots


def print_prompt_lines(records, tok, human) -> None:
    """A batch run's line a prompt (`prompt k: ids -> generated ids`, the text where a tokenizer is at hand) on
    `human`, for `run`'s batch and `run --ranks R`'s."""
    for k, rec in enumerate(records, 1):
        line = f"prompt {k}: {','.join(map(str, rec['prompt_ids']))} -> {','.join(map(str, rec['generated_ids']))}"
        if tok is not None:
            line += f"  {tok.decode(rec['generated_ids'])!r}"
        print(line, file=human)
    sys.stdout.flush()
