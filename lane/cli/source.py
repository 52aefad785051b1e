"""What a MODEL argument names: the built-in demo model (none given), a checkpoint folder, a GGUF file (or a folder
holding one), or a step YAML."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lanefuse.engine.errors import UserError
from lanefuse.engine.jsonfile import read_json
from lanefuse.engine.ir import Graph
from lanefuse.engine.front.model import ModelConfig, build_step


@dataclass
class Source:
    name: str
    cfg: ModelConfig | None  # None for a step YAML without a model behind it
    weights: object | None
    step: Graph | None = None  # a step YAML's own graph
    path: str | None = None
    ctx_said: str = ""  # the KV caches' rows and why (`--ctx`), said in the output
    no_weights: str = ""  # why there are no weights to run, where a folder holds only config.json
    shape_said: str = ""  # a config-only folder: what the plan assumes of the weights
    tokenizer: object | None = None  # a GGUF file's: builds the tokenizer its metadata holds (for --prompt)
    eos: tuple[int, ...] = ()  # the end-of-sequence ids the model's config names (a batch's sequences end there)
    chat: object | None = None  # a GGUF file's: a user message through its chat template, as text (--chat)

    def graph(self, rows: int = 1, batch: int = 1, last: int = 1) -> Graph:
        """The step of `rows` rows (`batch` sequences); `last` > 1: the logits of the chunk's last `last` rows (a
        verifier of last - 1 drafted tokens: a view of those rows of the residual, engine/front/model.build_step)."""
        if self.step is not None:
            if last > 1:
                raise UserError(f"{self.name}: a step YAML is one step of its own; --last needs a model (a checkpoint "
                                f"folder, a GGUF file or the demo)")
            if batch > 1:
                raise UserError(f"{self.name}: a step YAML is one step of its own; --batch needs a model (a "
                                f"checkpoint folder, a GGUF file or the demo)")
            if rows != int(self.step.meta.get("rows", 1)):
                raise UserError(f"{self.name}: the step YAML is a step of {self.step.meta.get('rows', 1)} rows, "
                                f"not {rows}")
            return self.step
        assert self.cfg is not None
        if last > rows:
            raise UserError(f"--last {last}: the logits of the last {last} rows of a step of {rows} (give --rows of at "
                            f"least {last})")
        return build_step(self.cfg, rows, batch=batch, last=last)


def eos_ids(value) -> tuple[int, ...]:
    """config.json's `eos_token_id` (an id, a list of them, or absent) as a tuple of ids."""
    if isinstance(value, bool) or value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def open_model(model: str | None, progress: bool = False, ctx: int | None = None,
               weights_format: str | None = None) -> Source:
    """Resolve MODEL: nothing -> the demo model; a folder -> an HF checkpoint (or, holding only config.json, its
    shape without weights; or, holding one .gguf file and no config.json, that file); a .gguf file; a .yaml/.yml
    file -> a step YAML. `ctx`: the KV caches' rows (default: `context_rows`)."""
    if ctx is not None and ctx < 1:
        raise UserError(f"--ctx {ctx}: give at least 1 row")
    if model is None or model == "demo":
        from lanefuse.engine.front.demo import demo_config, demo_model

        rows, said = context_rows(DEMO_CTX, demo_config(), ctx, "the demo model")
        cfg, weights = demo_model(rows)
        if weights_format and weights_format != "f32":
            cfg, weights = _demo_in(cfg, weights_format)
        return Source("demo", cfg, weights, ctx_said=said)
    if not os.path.exists(model):
        raise UserError(f"{model}: no such file or folder (give a checkpoint folder, a step YAML, or nothing for "
                        f"the demo model)")
    if os.path.isdir(model):
        return _open_folder(model, ctx, weights_format)
    if model.endswith(".gguf"):
        return _open_gguf(model, ctx, weights_format)
    if ctx is not None or weights_format:
        flag = "--ctx" if ctx is not None else "--weights-format"
        if model.endswith((".yaml", ".yml")):
            raise UserError(f"{model}: {flag} is for a checkpoint folder or the demo model (a step YAML fixes its "
                            f"caches' rows and its weights' formats)")
    if model.endswith((".yaml", ".yml")):
        from lanefuse.engine.front.stepweights import step_weights
        from lanefuse.engine.stepyaml import from_yaml

        from lanefuse.engine.yamlsafe import read_text

        g = from_yaml(read_text(model), source=model)  # unreadable or not UTF-8: a UserError naming the file
        weights = step_weights(g, base=os.path.dirname(os.path.abspath(model))) if g.meta.get("weights") else None
        return Source(os.path.basename(model), None, weights, step=g, path=model)
    base = os.path.basename(model)
    if base.endswith(".safetensors") or base in CHECKPOINT_FILES:  # a file of a checkpoint: the folder is MODEL
        folder = os.path.dirname(os.path.abspath(model))
        raise UserError(f"{model}: is a file of a checkpoint folder; give the folder: `{folder}`")
    raise UserError(f"{model}: not a checkpoint folder, a .gguf file or a step YAML (.yaml)")


CHECKPOINT_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                    "generation_config.json")  # the files of a Hugging Face checkpoint folder


def open_for(args, model: str | None = None, progress: bool = False, ctx: int | None = None) -> Source:
    """`open_model` under the command's --ctx and --weights-format (`ctx`: the rows a saved plan was made for, where
    --ctx is not given)."""
    given = getattr(args, "ctx", None)
    src = open_model(model, progress, given or ctx, getattr(args, "weights_format", None))
    if given is None and ctx is not None:
        src.ctx_said = src.ctx_said.replace("(--ctx;", "(the saved plan's;")
    return src


DEMO_CTX = 256  # the demo model's positions: its goldens are pinned at this cache length
CTX_CAP = 4096  # the default cache rows at most, where the model allows more
CTX_MEMORY = 0.25  # ... and at most this share of the machine's memory for the KV caches (f32)
FORMATS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # torch_dtype -> checkpoint format


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def context_rows(allowed: int, cfg: ModelConfig, ctx: int | None, who: str) -> tuple[int, str]:
    """The KV caches' rows: `ctx` where given (at most the `allowed` positions), else the allowed ones capped at
    CTX_CAP and by memory; and the sentence that says so."""
    row_bytes = cfg.layers * sum(cfg.cache_widths) * 4  # f32 keys and values (a family's own rows), every layer
    mem = _memory_bytes()
    if ctx is not None:
        if ctx > allowed:
            raise UserError(f"--ctx {ctx}: {who} allows at most {allowed} positions")
        _fits(cfg, ctx, mem, f"--ctx {ctx}: ", "give a smaller --ctx")  # checked before anything is allocated
        return ctx, f"KV cache: {ctx} rows (--ctx; {ctx * row_bytes / 2**20:.1f} MiB; the model allows {allowed})"
    rows, why = allowed, "what the model allows"
    if rows > CTX_CAP:
        rows, why = CTX_CAP, f"the model allows {allowed}; capped at {CTX_CAP}"
    if mem and rows * row_bytes > CTX_MEMORY * mem:
        rows = max(1, int(CTX_MEMORY * mem // row_bytes))
        why = f"the model allows {allowed}; capped by memory: {CTX_MEMORY:.0%} of {mem / 2**30:.0f} GiB"
    _fits(cfg, rows, mem, f"{who}: ", "its sizes are wrong, or the machine too small")
    return rows, f"KV cache: {rows} rows ({why}; {rows * row_bytes / 2**20:.1f} MiB; --ctx N to change)"


def _fits(cfg: ModelConfig, rows: int, mem: int | None, what: str, todo: str) -> None:
    """Refuse a step whose carried tables (the KV caches of `rows` rows, a family's recurrent states) would take more
    than CTX_MEMORY of the machine's memory (f32), before anything allocates them."""
    import dataclasses
    import math

    if not mem:
        return
    need = 4 * sum(math.prod(shape) for shape in dataclasses.replace(cfg, max_len=rows).carried().values())
    if need > CTX_MEMORY * mem:
        raise UserError(f"{what}the KV caches and carried states of {rows} rows need {need / 2**30:,.1f} GiB, more "
                        f"than the {CTX_MEMORY:.0%} of this machine's {mem / 2**30:.0f} GiB they may take; {todo}")


def _read_config(folder: str) -> tuple[str, dict]:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise UserError(f"{folder}: no config.json in this folder (expected a Hugging Face checkpoint folder or a "
                        f"folder holding one .gguf file)")
    raw = read_json(path, "config.json is JSON")  # as the front reads it, so both say the same of a broken one
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a JSON object")
    return path, raw


def _demo_in(cfg, fmt: str):
    """The demo model with its checkpoint rows (every matrix) stored in `fmt` (--weights-format): the same seeded
    values, encoded (a block format: quantized, so the numbers are the quantized weights')."""
    import dataclasses

    from lanefuse.engine.front.demo import random_arrays
    from lanefuse.engine.front.weights import Weights
    from lanefuse.engine.formats.blocks import encode_matrices

    arrays = encode_matrices(random_arrays(cfg), fmt)
    cfg = dataclasses.replace(cfg, formats=tuple((n, f) for n, (_, f) in arrays.items() if f != "f32"))
    return cfg, Weights.from_dict(arrays, cfg)


def _block_rows(cfg, fmt: str, whence: str) -> None:
    """Refuse a block format some checkpoint rows of the model cannot be held in (a row not whole blocks), naming the
    first such tensor."""
    from lanefuse.engine.formats.blocks import BLOCKS, row_refusal

    if fmt not in BLOCKS:
        return
    for name, shape in cfg.weight_names().items():
        why = row_refusal(fmt, shape[-1]) if len(shape) == 2 else None
        if why:
            raise UserError(f"{whence} {fmt}: tensor `{name}` {list(shape)} cannot be held in it ({why}); choose "
                            f"another format")


def _open_folder(folder: str, ctx: int | None, weights_format: str | None) -> Source:
    """A checkpoint folder; one holding config.json and no safetensors is the model's shape alone: it plans and
    explores, with each weight's format from --weights-format or the config's torch_dtype, and does not run."""
    import dataclasses
    from pathlib import Path

    from lanefuse.engine.front.gguf import find_gguf
    from lanefuse.engine.front.hfconfig import config_from_hf

    if not os.path.exists(os.path.join(folder, "config.json")):
        one = find_gguf(Path(folder))  # several: refused, named
        if one is not None:
            return _open_gguf(str(one), ctx, weights_format)
    path, raw = _read_config(folder)
    name = os.path.basename(os.path.abspath(folder))
    shape = config_from_hf(raw, path, max_len=1 << 30, name=name)  # the positions the model allows: its max_len
    allowed = int(raw.get("max_position_embeddings") or 512)
    rows, said = context_rows(allowed, shape, ctx, f"{name} (max_position_embeddings in config.json)")
    has_weights = any(f.endswith(".safetensors") for f in os.listdir(folder))
    if has_weights:
        if weights_format:
            raise UserError(f"--weights-format {weights_format}: {folder} holds safetensors, which give each "
                            f"tensor's format (the flag is for a folder holding only config.json)")
        from lanefuse.engine.front.load import load_model

        cfg, weights = load_model(folder, max_len=rows)  # its progress bar shows where stderr is a terminal
        eos = eos_ids(raw.get("eos_token_id", (raw.get("text_config") or {}).get("eos_token_id")))
        return Source(os.path.basename(os.path.normpath(folder)), cfg, weights, path=folder, ctx_said=said, eos=eos)
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    fmt = weights_format or FORMATS.get(str(dtype))
    if fmt is None:
        raise UserError(f"{folder}: config.json and no weights (*.safetensors), and its torch_dtype "
                        f"({dtype!r}) names no checkpoint format: give --weights-format "
                        f"f32|f16|bf16|q8_0|q4_0|q4_k|q6_k|... to plan its shape")
    cfg = config_from_hf(raw, path, max_len=rows, name=name)
    cfg = dataclasses.replace(cfg, formats=tuple((w, fmt) for w in cfg.weight_names()))
    whence = "--weights-format" if weights_format else f"config.json's torch_dtype {dtype}"
    _block_rows(cfg, fmt, whence)
    return Source(os.path.basename(os.path.normpath(folder)), cfg, None, path=folder, ctx_said=said,
                  no_weights=f"{folder}: config.json and no weights (*.safetensors): `plan` and `explore` take its "
                             f"shape ({fmt} weights, from {whence}); `run` and `check` need the checkpoint's tensors",
                  shape_said=f"shape only: no weights in {folder}; weights planned as {fmt} (from {whence})")


def _open_gguf(path: str, ctx: int | None, weights_format: str | None) -> Source:
    """A GGUF file: its config from the metadata, its tensors memory-mapped, its tokenizer on demand."""
    import dataclasses

    from lanefuse.engine.front.load import load_model

    if weights_format:
        raise UserError(f"--weights-format {weights_format}: {path} is a GGUF file, which gives each tensor's format "
                        f"(the flag is for a folder holding only config.json)")
    cfg, weights = load_model(path, max_len=1 << 30)  # the KV caches' rows: the file's context length, for now
    from lanefuse.engine.front.family import gguf_arch

    arch = gguf_arch(cfg)  # the file's `general.architecture`, as its family reads it
    name = os.path.basename(path)
    rows, said = context_rows(cfg.max_len, cfg, ctx, f"{name} ({arch or 'its'}.context_length in the file)")
    cfg = dataclasses.replace(cfg, max_len=rows)
    store = weights.store
    while not hasattr(store, "reader"):  # a mixture's store serving stacked experts over the file's (its `base`)
        store = store.base
    reader = store.reader

    def tokenizer():
        from lanefuse.engine.front.gguf_vocab import tokenizer_from_gguf

        return tokenizer_from_gguf(reader, path)

    def chat(text: str) -> str:
        from lanefuse.engine.front.gguf_vocab import chat_text

        return chat_text(reader, path, text)

    field = reader.fields.get("tokenizer.ggml.eos_token_id")
    eos = (int(field.parts[field.data[0]][0]),) if field is not None and field.data else ()
    return Source(name, cfg, weights.with_config(cfg), path=path, ctx_said=said, tokenizer=tokenizer, eos=eos,
                  chat=chat)
