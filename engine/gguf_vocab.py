"""The tokenizer a GGUF file holds in its metadata (`tokenizer.ggml.*`), built with the `tokenizers` package as
llama.cpp tokenizes: byte-level BPE (`gpt2`, with the pre-tokenizer regexes `tokenizer.ggml.pre` names, from llama.cpp's
src/llama-vocab.cpp) and SentencePiece (`llama`: pieces merged by score, unknown bytes as <0xXX> tokens). Control
tokens in the text are matched as themselves (llama.cpp's parse_special), BOS added where the file says."""

from __future__ import annotations

from typing import Any

from lanefuse.engine.errors import UserError
from lanefuse.engine.gguf import shown

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
           "|\\s+(?!\\S)|\\s+")
_QWEN2 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
          "|\\s+(?!\\S)|\\s+")
_DEFAULT = ["[\\p{P}\\$\\+<=>\\^~\\|]+", _GPT2, "\\p{N}+", "[0-9][0-9][0-9]"]

# tokenizer.ggml.pre -> the regexes llama.cpp splits the text by, in order
PRE_REGEXES: dict[str, list[str]] = {
    "default": _DEFAULT,
    "gpt-2": [_GPT2],
    "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "llama-bpe": [_LLAMA3],
    "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2],
}
IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe")  # a word that is a token is that token (llama.cpp, Llama 3)
ADD_BOS = ("llama3", "llama-v3", "llama-bpe")  # llama.cpp's default where the file has no add_bos_token
CONTROL, USER_DEFINED, BYTE = 3, 4, 6  # gguf.TokenType


def _field(reader, key: str, where: str, default: Any = None, required: bool = False) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise UserError(f"{where}: missing `{key}` (the file's tokenizer)")
        return default
    return f.contents()


def tokenizer_from_gguf(reader, where: str):
    """A `tokenizers.Tokenizer` of the file's vocabulary (`reader`: its gguf.GGUFReader)."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise UserError("--prompt needs the `tokenizers` package (pip install tokenizers)") from None
    model = _field(reader, "tokenizer.ggml.model", where)
    if model is None:
        raise UserError(f"{where}: the file holds no tokenizer (`tokenizer.ggml.model`); give --prompt-ids")
    tokens = _field(reader, "tokenizer.ggml.tokens", where, required=True)
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) or not tokens:
        raise UserError(f"{where}: `tokenizer.ggml.tokens` is not a list of strings")
    types = _field(reader, "tokenizer.ggml.token_type", where, [1] * len(tokens))
    if not isinstance(types, list) or len(types) != len(tokens):
        raise UserError(f"{where}: `tokenizer.ggml.token_type` holds {len(types) if isinstance(types, list) else '?'}"
                        f" entries for {len(tokens)} tokens")
    if model == "gpt2":
        tok, add_bos_default = _bpe(reader, where, tokens)
    elif model == "llama":
        tok, add_bos_default = _spm(reader, where, tokens, types)
    else:
        raise UserError(f"{where}: `tokenizer.ggml.model` is `{shown(model)}`; lanefuse builds gpt2 (byte-level "
                        f"BPE) and llama (SentencePiece) tokenizers")
    _specials(tok, tokens, types, byte_level=model == "gpt2")
    _bos(tok, reader, where, tokens, add_bos_default)
    return tok


def _bpe(reader, where: str, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = _field(reader, "tokenizer.ggml.pre", where, "default")
    if pre not in PRE_REGEXES:
        raise UserError(f"{where}: `tokenizer.ggml.pre` is `{shown(pre)}`, a pre-tokenizer lanefuse does not "
                        f"build (it builds {', '.join(PRE_REGEXES)}); give --prompt-ids")
    merges = _field(reader, "tokenizer.ggml.merges", where, required=True)
    pairs = []
    for m in merges:
        pos = m.find(" ", 1) if isinstance(m, str) else -1  # as llama.cpp splits it: the first space after the start
        if pos < 0:
            raise UserError(f"{where}: `tokenizer.ggml.merges` entry {m[:40]!r} is not two tokens and a space")
        pairs.append((m[:pos], m[pos + 1:]))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre in IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_REGEXES[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, pre in ADD_BOS


def _spm(reader, where: str, tokens: list[str], types: list[int]):
    """SentencePiece as llama.cpp runs it: spaces as ▁ (one prepended), adjacent pieces merged while the merged piece
    is a token, the highest score first; a character no token holds as its UTF-8 byte tokens <0xXX>."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _field(reader, "tokenizer.ggml.scores", where, [0.0] * len(tokens))
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise UserError(f"{where}: `tokenizer.ggml.scores` does not hold one score a token")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    score_of = {t: scores[i] for t, i in vocab.items()}
    # the merges that make each piece, ranked by the piece's score (llama.cpp's bigram queue), then its id
    merges = []
    for t, i in vocab.items():
        if types[i] != 1 or len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                merges.append((-score_of[t], i, k, a, b))
    merges.sort()
    unk = _field(reader, "tokenizer.ggml.unknown_token_id", where, 0)
    tok = Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in merges], unk_token=tokens[unk] if 0 <= unk < len(tokens)
                               else None, byte_fallback=True, fuse_unk=True))
    norm = [normalizers.Replace(" ", "▁")]
    if _field(reader, "tokenizer.ggml.add_space_prefix", where, True):
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok, True


def _specials(tok, tokens: list[str], types: list[int], byte_level: bool) -> None:
    """Control tokens matched in the text as themselves (special: left out of decoded text), user-defined ones too."""
    from tokenizers import AddedToken

    ctrl = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL and t]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED and t]
    if ctrl:
        tok.add_special_tokens(ctrl)
    if user:
        tok.add_tokens(user)


def _bos(tok, reader, where: str, tokens: list[str], default: bool) -> None:
    from tokenizers import processors

    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", where, default)
    add_eos = _field(reader, "tokenizer.ggml.add_eos_token", where, False)
    parts, specials = ["$A"], []
    for flag, key, front in ((add_bos, "tokenizer.ggml.bos_token_id", True),
                             (add_eos, "tokenizer.ggml.eos_token_id", False)):
        if not flag:
            continue
        i = _field(reader, key, where)
        if not isinstance(i, int) or not 0 <= i < len(tokens):
            raise UserError(f"{where}: the tokenizer adds a {key.split('.')[-1][:3]} token, but `{key}` is "
                            f"{i!r} (expected a token id below {len(tokens)})")
        parts.insert(0 if front else len(parts), tokens[i])
        specials.append((tokens[i], i))
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=parts, special_tokens=specials)
