"""HeadGemv `part` (issue 40 item 4, seed 002's HeadGemv `part`): a per-head product reading each head's a values as a
part of a wider row (an access: pitch, offset), as DeepSeek-V3's absorbed query does in the seed's spelling — one
query projection of every head's unrotated and rotated values, each head's unrotated part multiplied by its key
expansion in place, no slice launch. The real front cuts the projection's rows instead (deepseek.py `nope_rows`), so a
step YAML with the access is what reaches it: planned here from a model-shaped graph (a decode step) against the
reference interpreter; the real head_gemv.cu by the host emulator against the numpy twin with and without the part;
the refusal of a part that is not a head's values."""

from __future__ import annotations

import numpy as np
import pytest

import test_kernels_gpu as gpu
from cuda_host import emu
from lanefuse.engine.stepyaml import from_yaml
from lanefuse.kernels import Dst, HeadGemv, Part
from lanefuse.kernels.common import encode
from test_kernels_emulated import again_same
from test_placement import HEAD, _against_reference

r32 = gpu.r32


def absorbed(rows: int) -> str:
    """A DeepSeek-V3-shaped absorbed query: 3 heads of 6 unrotated and 2 rotated values in one projection (width 24),
    each head's unrotated part (pitch 8, offset 0, width 6) times its key expansion (6 -> latent 5), then the head."""
    text = HEAD.replace("meta: {model: placement, rows: 1}", f"meta: {{model: absorbed-query, rows: {rows}}}")
    text = text.replace("token: i32[1]", f"token: i32[{rows}]").replace(
        "emb: {shape: [32, 8]}", "emb: {shape: [32, 8]}\n  wq: {shape: [24, 8], transposed: true}\n"
                                 "  wkb: {shape: [18, 5]}").replace(
        "wo: {shape: [32, 8], transposed: true}", "wo: {shape: [32, 15], transposed: true}")
    return text + """  - {op: gather, out: x, ins: [emb, token]}
  - {op: matmul, out: q, ins: [x, wq]}
  - {op: head_matmul, out: ql, ins: [q, wkb], access: [[8, 0, 6], null], heads: 3, a: 6, b: 5, rows_out: false}
  - {op: matmul, out: logits, ins: [ql, wo]}
  - {op: argmax, out: next, ins: [logits]}
"""


def test_a_model_shaped_absorbed_query_reads_each_heads_part_in_place():
    rows = 1
    g = from_yaml(absorbed(rows), source="absorbed.yaml")
    s = _against_reference(g)
    heads = [x.launch for x in s.launches if x.launch.census == "head_gemv"]
    assert len(heads) == 1 and heads[0].part == Part(8, 0, 6) and heads[0].m == rows
    assert "slice" not in s.census  # no copy of the unrotated parts


@pytest.fixture(scope="module")
def emulated():
    with emu.emulating([HeadGemv.stem]) as env:
        yield env


@pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")
@pytest.mark.parametrize("fmt,rows_out", [("f32", False), ("bf16", True), ("q8_0", True)])
@pytest.mark.parametrize("part", [None, Part(40, 3, 32)])
def test_the_kernel_reads_the_part_as_the_twin(emulated, fmt, rows_out, part):
    m, heads, a, b = 3, 2, 32, 7
    g = np.random.default_rng(a + b + (part is None))
    x = r32(g, m * heads * (part.pitch if part else a))
    w = r32(g, heads * b, a) if rows_out else r32(g, heads * a, b)
    launch = HeadGemv("x", "w", fmt, Dst("y"), m, heads, a, b, rows_out=rows_out, part=part)
    dev = gpu.both(launch, {"x": x, "y": np.zeros(m * heads * b, np.float32)}, {"w": (encode(w, fmt), fmt)}, tol=2e-4)
    again_same(launch, dev, ["y"])
    if part is not None:  # the kernel over each head's values of the wider row: its bits over them cut out
        cut = x.reshape(m * heads, part.pitch)[:, part.offset:part.offset + a].reshape(-1)
        whole = HeadGemv("c", "w", fmt, Dst("y2"), m, heads, a, b, rows_out=rows_out)
        dev2 = gpu.both(whole, {"c": cut, "y2": np.zeros(m * heads * b, np.float32)}, {"w": (encode(w, fmt), fmt)},
                        tol=2e-4)
        np.testing.assert_array_equal(dev.host("y"), dev2.host("y2"))


def test_a_part_that_is_not_a_heads_values_is_refused_in_one_line():
    why = HeadGemv("x", "w", "f32", Dst("y"), 1, 2, 6, 5, part=Part(8, 4, 6)).check()
    assert why is not None and "offset 4 of every 8" in str(why) and "\n" not in str(why)
