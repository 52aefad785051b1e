"""The GGUF loaders' shared checks (gguf.py and the families with their own keys, families/deepseek.py and
engine/front/families/gptoss.py): the vocabulary's size and each tensor's shape against what the metadata makes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lanefuse.engine.errors import UserError


def vocab_size(meta: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], r: Any, where: str) -> int:
    """The vocabulary's size (`r`: engine/front/hfconfig.py's reader of the file's keys): `{arch}.vocab_size`, else the
    length of the token list, else the embedding's rows; a file without `token_embd.weight` is refused."""
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise UserError(f"{where}: the file has no tensor `token_embd.weight` (the token embedding)")
    if r.has("vocab_size"):
        return r.size("vocab_size")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and (isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__")):
        raise UserError(f"{where}: `tokenizer.ggml.tokens` is {str(tokens)[:40]!r}; expected a list of tokens")
    return len(tokens) if tokens is not None and len(tokens) else embd[0][0]


def check_shapes(store, have: set[str], want: dict[str, tuple[int, ...]], where: str, counts: str,
                 absent: Callable[[str, tuple[int, ...]], str]) -> None:
    """Each tensor of `want` (a name `store` serves -> the shape the metadata makes it) in `store` (`have`: its
    names) and of that shape, in order: one absent is refused in the words `absent(name, shape)` gives, one of
    another shape by both shapes and `counts` (the metadata's numbers that make it), named as the file names it."""
    for name, shape in want.items():
        if name not in have:
            raise UserError(f"{where}: {absent(name, shape)}")
        got = tuple(store.info(name)[0])
        if got != shape:
            raise UserError(f"{where}: tensor `{store.file_name(name)}` has shape {got}; the metadata makes it "
                            f"{shape} ({counts})")
