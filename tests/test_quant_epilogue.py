"""kernels/quant.py's QuantEpilogue (issue 39 item 6): every launch kind that quantizes its result in the epilogue
takes its refusal, bytes, twin's write and kernel arguments from the one mixin, whose answers are the primitives'
(quant_check, quant_bytes, quant_write, denv.quant) for the words field the kind names; and the mixin holds no
dataclass field, so no kind's field order (its repr, saved plan and plan digests) moves."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lanefuse.engine.formats.quantize import quantize
from lanefuse.kernels import KINDS, Dst, Gemv, HostEnv, Norm, RopeSide, SetRow
from lanefuse.kernels.common import Q8K, QSUM, qblock
from lanefuse.kernels.cupy_env import NULL
from lanefuse.kernels.quant import QuantEpilogue, quant_bytes, quant_check, quant_layout


def _epilogue_kinds():
    return [k for k in (*KINDS.values(), RopeSide) if "quant" in {f.name for f in dataclasses.fields(k)}]


def test_every_kind_that_quantizes_its_result_takes_the_mixin():
    kinds = _epilogue_kinds()
    assert {k.__name__ for k in kinds} >= {"Attention", "Binary", "Delta", "Gemv", "GemvGlu", "HeadGemv", "Moe",
                                           "Norm", "RopeSide", "SetRow"}
    for k in kinds:
        if getattr(k, "census", "") in ("gemm_tc_glu", "gemm_blas_glu", "gemm_deq_glu"):  # GemvGlu's fields; the
            # tensor cores (and cuBLAS's forms of them) refuse a quantized form
            continue
        assert issubclass(k, QuantEpilogue), f"{k.__name__} has a `quant` field but threads it by hand"
        names = {f.name: f for f in dataclasses.fields(k)}
        assert k.words_field in names and names[k.words_field].default == 0, (k.__name__, k.words_field)


def test_the_mixin_holds_no_field():
    """Its fields stay the kinds' own, where they stand in each kind's order (a dataclass base's would come first)."""
    assert not dataclasses.is_dataclass(QuantEpilogue)
    norm = [f.name for f in dataclasses.fields(Norm)]
    assert norm[-3:] == ["quant", "words", "f32"] and norm[:3] == ["x", "w", "out"]


def _norm(quant, words=1, f32=True, cols=64):
    return Norm("x", "w", "y", 2, cols, 1e-5, quant=quant, words=words, f32=f32)


def _gemv(quant, quant_words=1, words=0, n=64):
    return Gemv("x", "w", "bf16", Dst("y"), 32, n, 2, words=words, quant=quant, quant_words=quant_words)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 1024), words=st.sampled_from([0, 1, 2, Q8K, 4]), act_words=st.sampled_from([0, 1]))
def test_refusal_and_bytes_are_the_primitives(n, words, act_words):
    """The words come from the field the kind names (Gemv: quant_words, not its activation's words); none written:
    no refusal and no bytes."""
    for launch in (_norm("q", words=words, cols=n), _gemv("q", quant_words=words, words=act_words, n=n)):
        assert launch.epilogue_words == words
        assert launch.epilogue_refusal(n, "a row") == quant_check(n, words, "a row", k_form=True)
        assert launch.epilogue_bytes(2 * n) == quant_bytes(2 * n, words)
    for launch in (_norm(None, words=words, cols=n), _gemv(None, quant_words=words, words=act_words, n=n)):
        assert launch.epilogue_words == 0
        assert launch.epilogue_refusal(n, "a row") is None and launch.epilogue_bytes(2 * n) == 0


def test_set_row_is_refused_the_q8k_form():
    """SetRow's kernel writes q8 and q8x2 forms only (k_form False): the q8k form is refused in words."""
    s = SetRow("t", "s", "pos", 256, 1, 4, quant="tq", words=Q8K)
    assert "only the Quant launch writes that form" in str(s.check())
    assert s.epilogue_refusal(1024, "a table") == quant_check(1024, Q8K, "a table", k_form=False)


def test_written_refusal_and_the_stored_name():
    assert _norm("q", f32=False).stored("y") is None and _norm("q").stored("y") == "y"
    assert _gemv("q").stored("y") == "y"  # a kind with no `f32` field always writes its result
    why = _norm(None, f32=False).written_refusal("a norm", "result")
    assert str(why) == "a norm that writes neither its result nor its quantized form"
    assert _norm("q", f32=False).written_refusal("a norm", "result") is None


@pytest.mark.parametrize("words", [1, 2, Q8K])
@pytest.mark.parametrize("start", [0, 256])
def test_the_twins_write_is_quant_write(words, start):
    """From value `start` on (a batch launch's first row), the form's words, low words or sums and scales as
    quantize() gives them; nothing written where the launch has no form."""
    n, total = 512, 1024
    lo, sc, size = quant_layout(total, words)
    g = np.random.default_rng(words)
    v = g.standard_normal((2, n // 2)).astype(np.float32)
    w = np.zeros(total, np.int8)
    low = np.zeros(total if words == 2 else 2 * total // QSUM, np.int8 if words == 2 else np.int16)
    scales = np.zeros(total // qblock(words), np.float32)
    env = HostEnv(quantized={"q": (w, low if words != 1 else None, scales)})
    _norm("q", words=words, cols=n // 2).epilogue_write(env, v, start=start)
    q = quantize(v.reshape(1, -1), words)
    np.testing.assert_array_equal(w[start: start + n], q.words.reshape(-1))
    np.testing.assert_array_equal(scales[start // qblock(words): (start + n) // qblock(words)], q.scales.reshape(-1))
    if words == 2:
        np.testing.assert_array_equal(low[start: start + n], q.low.reshape(-1))
    if words == Q8K:
        np.testing.assert_array_equal(low[start // QSUM: (start + n) // QSUM], q.sums.reshape(-1))
    assert not w[:start].any() and not w[start + n:].any()
    before = w.copy()
    _norm(None, words=words).epilogue_write(env, v)  # no form: nothing written
    np.testing.assert_array_equal(w, before)


class _Denv:
    """The device env's quantized forms as tags, to see which the arguments name."""

    def quant(self, name):
        return (f"{name}.words", f"{name}.low", f"{name}.scales")

    def quant_addresses(self, name):
        return (11, 0, 13)


def test_kernel_arguments():
    d = _Denv()
    assert _norm("q", words=2).epilogue_args(d) == ("q.words", "q.low", "q.scales", 2)
    assert _norm(None, words=2).epilogue_args(d) == (NULL, NULL, NULL, 0)
    assert _gemv("q", quant_words=Q8K, words=1).epilogue_args(d)[3] == Q8K
    side = RopeSide("x", Dst("y"), 1, rot=0, quant="q", words=Q8K)
    assert side.epilogue_addresses(d) == (11, 0, 13, Q8K)
    assert RopeSide("x", Dst("y"), 1).epilogue_addresses(d) == (0, 0, 0, 0)
