"""llama.cpp's own intermediate tensors (llama-cpp-python, CPU): a prompt evaluated in one batch with the context's
eval callback (`cb_eval`) copying out each contiguous f32 tensor the graph computes, by its name (`attn_norm-0`,
`Qcur-0`, `kqv_out-0`, `ffn_swiglu-0`, `result_norm`, ...), the first value of a name and its last. The KV cache is
f32, flash attention off, and llama.cpp's extra weight buffers off (`use_extra_bufts`: its AMX and repacked kernels;
AMX faults in this sandbox, and they are other products than the ones parity is measured against)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

GGML_TYPE_F32 = 0


class _Tensor(ctypes.Structure):  # ggml.h's struct ggml_tensor (GGML_MAX_DIMS 4, MAX_OP_PARAMS 64, MAX_SRC 10)
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


class Dump:
    """The tensors one evaluation computed: `first(name)` / `last(name)` as (rows, values a row) f32 arrays (ggml's
    ne[0] the fastest axis: a row of a matmul's output is one token's)."""

    def __init__(self):
        self.seen: dict[str, list[np.ndarray]] = {}

    def add(self, name: str, a: np.ndarray) -> None:
        self.seen.setdefault(name, []).append(a)

    def first(self, name: str) -> np.ndarray:
        return self.seen[name][0]

    def last(self, name: str) -> np.ndarray:
        return self.seen[name][-1]


def llama_cpp(**overrides):
    """llama_cpp with its default model / context parameters changed as `overrides` says (model: use_extra_bufts;
    context: cb_eval), for the Llama objects made inside the `with`."""
    import contextlib

    import llama_cpp as lc
    import llama_cpp.llama_cpp as low

    @contextlib.contextmanager
    def patched():
        model0, ctx0 = low.llama_model_default_params, low.llama_context_default_params

        def model():
            p = model0()
            p.use_extra_bufts = False
            return p

        def ctx():
            p = ctx0()
            for k, v in overrides.items():
                setattr(p, k, v)
            return p

        low.llama_model_default_params, low.llama_context_default_params = model, ctx
        try:
            yield lc
        finally:
            low.llama_model_default_params, low.llama_context_default_params = model0, ctx0

    return patched()


def _callback(sink):
    """A cb_eval that copies each contiguous f32 tensor computed into `sink[0]` (a Dump; swapped between evals)."""
    import llama_cpp.llama_cpp as low

    @low.ggml_backend_sched_eval_callback
    def cb(tp, ask, _):
        if ask:
            return True
        t = ctypes.cast(tp, ctypes.POINTER(_Tensor)).contents
        ne, nb = list(t.ne), list(t.nb)
        if t.type == GGML_TYPE_F32 and t.data and nb[0] == 4 and nb[1] == 4 * ne[0] and nb[2] == nb[1] * ne[1] \
                and nb[3] == nb[2] * ne[2]:
            n = ne[0] * ne[1] * ne[2] * ne[3]
            a = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float)), shape=(n,))
            sink[0].add(t.name.decode(), a.reshape(-1, ne[0]).copy())
        return True

    return cb


def _model(lc, path: Path, n_ctx: int, rows: int):
    return lc.Llama(str(path), verbose=False, n_ctx=n_ctx, n_batch=max(512, rows), n_ubatch=max(512, rows),
                    n_threads=2, logits_all=True, type_k=lc.GGML_TYPE_F32, type_v=lc.GGML_TYPE_F32, flash_attn=False)


def dump(path: Path, prompt: list[int], n_ctx: int = 256) -> tuple[Dump, np.ndarray]:
    """Evaluate `prompt` in one batch on GGUF file `path`: every contiguous f32 tensor computed, and the logits of
    each prompt row (rows, vocab)."""
    sink = [Dump()]
    with llama_cpp(cb_eval=_callback(sink)) as lc:
        ll = _model(lc, path, n_ctx, len(prompt))
        ll.eval(list(prompt))
        logits = np.array(ll.scores[: len(prompt)], dtype=np.float32)
    return sink[0], logits


def greedy_dumps(path: Path, prompt: list[int], n: int, n_ctx: int = 256):
    """llama.cpp's `n` greedy tokens after `prompt` (the prompt in one batch, then a token an eval) and, for each
    step, the tensors it computed and the logits the token came from: (tokens, [(Dump, logits)])."""
    sink = [Dump()]
    steps, toks = [], []
    with llama_cpp(cb_eval=_callback(sink)) as lc:
        ll = _model(lc, path, n_ctx, len(prompt))
        feed = list(prompt)
        for _ in range(n):
            sink[0] = Dump()
            ll.eval(feed)
            out = np.array(ll.scores[ll.n_tokens - 1], dtype=np.float32)
            steps.append((sink[0], out))
            toks.append(int(np.argmax(out)))
            feed = [toks[-1]]
    return toks, steps


def greedy(path: Path, prompt: list[int], n: int, n_ctx: int = 256) -> tuple[list[int], list[np.ndarray]]:
    """llama.cpp's `n` greedy tokens after `prompt` and the logits each came from (its extra buffers off, as above)."""
    with llama_cpp() as lc:
        ll = lc.Llama(str(path), verbose=False, n_ctx=n_ctx, n_threads=2, logits_all=True, type_k=lc.GGML_TYPE_F32,
                      type_v=lc.GGML_TYPE_F32, flash_attn=False)
        ll.eval(list(prompt))
        toks, logits = [], []
        for _ in range(n):
            out = np.array(ll.scores[ll.n_tokens - 1], dtype=np.float32)
            toks.append(int(np.argmax(out)))
            logits.append(out)
            ll.eval([toks[-1]])
    return toks, logits
