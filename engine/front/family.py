"""A model family, the front's unit: the architectures it reads (config.json's `architectures`, a GGUF file's
`general.architecture` and its tensor names), how it reads a config into a `ModelConfig`, the store its checkpoints are
read through, and, by that config, the parts of its step that differ from the decoder skeleton's
(engine/front/decoder.py). The families (`families()`, FAMILIES) are found from the `Family` subclasses in families/,
as the kernels' KINDS is found from their launch kinds, on first use (the families import the readers, which ask
it); the readers and the CLI ask it, and nothing else names a family."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, ClassVar

from lanefuse.engine.errors import UserError, clip


class Family:
    """One family: a subclass in a module of families/ with a `name`. Its class methods are the front's questions;
    the defaults are a dense decoder's (transformers' Llama) answers."""

    name: ClassVar[str] = ""  # the family's key in FAMILIES
    hf: ClassVar[tuple[str, ...]] = ()  # config.json `architectures[0]` values it reads
    gguf: ClassVar[dict[str, Any]] = {}  # `general.architecture` -> its tensor names (gguf_names.Names)
    dense_gguf: ClassVar[bool] = True  # a GGUF file's shape read as any dense decoder's (engine/front/gguf.py),
    # the family's own keys over it (`from_gguf`); False: the family reads its own (`read_gguf`)

    @classmethod
    def read_config(cls, c: dict[str, Any], arch: str, where: str, max_len: int, name: str):
        """config.json `c` (architecture `arch`) read into the family's ModelConfig; a refusal names `where` and the
        key."""
        raise NotImplementedError(f"{cls.__name__}.read_config")

    @classmethod
    def names(cls, arch: str, meta: dict[str, Any]):
        """The tensor names of a GGUF file of `general.architecture` `arch` (its metadata `meta`)."""
        return cls.gguf[arch]

    @classmethod
    def read_gguf(cls, meta: dict[str, Any], tensors: dict, r, arch: str, where: str, max_len: int, name: str):
        """A GGUF file's ModelConfig read from its `{arch}.*` keys (`r`) alone, where not `dense_gguf`; `tensors`:
        GGUF name -> (shape, format)."""
        raise NotImplementedError(f"{cls.__name__}.read_gguf")

    @classmethod
    def from_gguf(cls, cfg, r, arch: str, where: str, meta: dict[str, Any], tensors: dict):
        """The family's own `{arch}.*` keys (`r` reads them) over the dense decoder's reading `cfg`."""
        return cfg

    @classmethod
    def store(cls, cfg, base, where: str):
        """The store the step reads a checkpoint folder's tensors through (`base`: the safetensors files'): each
        mixture layer's experts stacked (engine/front/families/mixtures.py), then the family's parts and cuts (its
        config's `split_store` / `serve`)."""
        if cfg.moe is not None:
            base = cfg.moe.stack(base, cfg, where)
        return cls.parts(cfg, base, where)

    @classmethod
    def gguf_store(cls, cfg, base, where: str):
        """The store the step reads a GGUF file's tensors through (`base`: engine/front/gguf.py's GGUFStore)."""
        return cls.store(cfg, base, where)

    @staticmethod
    def parts(cfg, base, where: str):
        """`base` served as the config asks: a family whose fused tensors the step reads in parts (`split_store`:
        Phi-3, Qwen3-Next), one serving tensors cut from the stored ones (`serve`: DeepSeek-V3)."""
        split = getattr(cfg, "split_store", None)
        if split is not None:
            base = split(base, where)
        serve = getattr(cfg, "serve", None)
        if serve is not None:
            base = serve(base, where)
        return base


def find_families() -> dict[str, type[Family]]:
    """Every family in families/'s modules by its name; an architecture two families claim is an error."""
    from lanefuse.engine.front import families as pkg

    found: dict[str, type[Family]] = {}
    claimed: dict[str, str] = {}
    for m in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{m.name}")
        for v in vars(mod).values():
            if not (isinstance(v, type) and issubclass(v, Family) and v.__module__ == mod.__name__ and v.name):
                continue
            for a in (*v.hf, *v.gguf):
                if a in claimed:
                    raise TypeError(f"families {claimed[a]} and {v.name} both read `{a}`")
                claimed[a] = v.name
            found[v.name] = v
    return found


_FOUND: dict[str, type[Family]] = {}


def families() -> dict[str, type[Family]]:
    """FAMILIES, found on first use (the families import the readers, which ask this)."""
    if not _FOUND:
        _FOUND.update(find_families())
    return _FOUND


def supported(gguf: bool = False) -> str:
    """The families and what each reads, for a refusal's one line: `llama: LlamaForCausalLM, ...; qwen: ...`."""
    return "; ".join(f"{n}: {', '.join(f.gguf if gguf else f.hf)}" for n, f in families().items()
                     if (f.gguf if gguf else f.hf))


def for_hf(arch: str | None, where: str) -> type[Family]:
    """The family reading config.json architecture `arch`; refused in one line listing FAMILIES."""
    for f in families().values():
        if arch in f.hf:
            return f
    raise UserError(f"{where}: architecture `{arch}` is not supported (supported: {supported()})")


def for_gguf(arch: str, where: str) -> type[Family]:
    """The family reading GGUF `general.architecture` `arch`; refused in one line listing FAMILIES."""
    for f in families().values():
        if arch in f.gguf:
            return f
    raise UserError(f"{where}: `general.architecture` is `{clip(arch, 40)}`, which lanefuse does not read (supported: "
                    f"{supported(gguf=True)})")


def of_config(cfg) -> type[Family]:
    """The family a ModelConfig was read by (its `arch`, a transformers architecture)."""
    return for_hf(cfg.arch, cfg.name)


def gguf_arch(cfg) -> str:
    """The GGUF `general.architecture` a model of `cfg.arch` is written as ('' where none is read)."""
    for f in families().values():
        for a, names in f.gguf.items():
            if cfg.arch in (names.hf_arch, names.mixture and names.mixture.hf_arch):
                return a
    return ""
