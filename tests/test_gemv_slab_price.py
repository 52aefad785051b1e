"""The lane's price of a GEMV-family launch at a slab of 3-8 rows of x (kernels/gemv.py slab_loop_us): where the slab
runs gemv_core.cu's gemv_tile_any (block formats, rows not whole 16-byte words), its dependent rounds of four values a
lane; one or two rows, and a slab through gemv_slab_cp's 16-byte ring (f32/f16/bf16), keep the bytes-over-bandwidth
price; a slab of block rows through the staged tile (one output a warp) is priced by its x's L1 reads. The constants are read off the kernels' sources, so a change there fails here."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from lanefuse.kernels import Dst, Fold, GemmPart, GemmParts, Gemv, GemvGlu, Norm
from lanefuse.kernels import gemv as G
from lanefuse.lane.lower.knobs import Knobs
from lanefuse.lane.lower.shim import launch_us

KERNELS = Path(G.__file__).resolve().parent
KN = Knobs()


def test_the_slab_constants_are_the_kernels():
    core = (KERNELS / "gemv_core.cu").read_text()
    s4, s1 = map(int, re.search(r"#define SLAB_STAGES\(PW\) \(\(PW\) >= 4 \? (\d+) : (\d+)\)", core).groups())
    assert G.SLAB_STAGES == {4: s4, 1: s1}
    assert G.GEMV_RESIDENT == int(re.search(r"#define GEMV_BOUNDS __launch_bounds__\(128, (\d+)\)", core).group(1))
    assert int(re.search(r"#define GR (\d+)", core).group(1)) == G.GEMV_ROWS


def launches(fmt, m, k=4096, n=4096):
    g = Gemv("x", "w", fmt, Dst("y"), k, n, m).tune(KN)
    glu = GemvGlu("x", "wg", "wu", fmt, "o", k, 3 * n, m).tune(KN)
    parts = GemmParts("x", fmt, k, m, (GemmPart("wq", Dst("q"), n), GemmPart("wk", Dst("kk"), n // 4))).tune(KN)
    fold = Fold(Gemv("x", "w", fmt, Dst("o"), k, n, m, per_warp=4), Norm("res", "nw", "y", m, n, 1e-6, add="o"))
    return g, glu, parts, fold


@pytest.mark.parametrize("fmt", ["bf16", "f32", "q8_0", "q4_k"])
def test_one_or_two_rows_keep_the_bytes_price(fmt):
    for m in (1, 2):
        for l in launches(fmt, m):
            assert l.loop_us(KN) == 0.0 and l.rate(KN) == KN.tflops_f32, (l, m)


@pytest.mark.parametrize("fmt,m", [("bf16", 3), ("bf16", 8), ("f16", 5), ("f32", 8), ("q8_0", 4), ("q4_k", 8),
                                   ("q4_0", 3)])
def test_a_slab_is_priced_by_its_loop(fmt, m):
    g, glu, parts, fold = launches(fmt, m)
    assert fold.fused and g.split == 1
    if fmt in ("bf16", "f16", "f32"):  # gemv_slab_cp: the bytes price it, as at one or two rows
        assert g.per_warp == 4
        for l in (g, glu, parts, fold):
            assert l.loop_us(KN) == 0.0 and l.rate(KN) == KN.tflops_f32
        return
    # block rows at a slab the staged tile takes (k 4096: whole runs of 256 values): one output a warp, priced by
    # every output's reads of its rows of x from L1 (knob l1_tbps); the weights' bytes price the rest
    assert g.per_warp == glu.per_warp == parts.per_warp == 1

    def l1_us(outputs, tiles=1):
        return outputs * 4096 * m * 4 * tiles / (KN.l1_tbps * 1e6)

    assert g.loop_us(KN) == pytest.approx(l1_us(4096))
    assert glu.loop_us(KN) == pytest.approx(l1_us(3 * 4096, 2))  # the gate's and the up's tiles
    assert parts.loop_us(KN) == pytest.approx(l1_us(sum(parts.blocks()) * G.WARPS))
    # at four outputs a warp (the fold's, as built here) the slab takes gemv_tile_any: 4096 x 4096 is 256 blocks,
    # one wave of 132 x 3; 32 rounds of 128 values a warp, many times the bytes' time
    rounds = 4096 // 128
    assert fold.loop_us(KN) == pytest.approx(rounds * KN.hbm_round_us)
    two = launches(fmt, 2)[3]
    assert launch_us(fold, KN) > 5 * launch_us(two, KN)
    for l in (g, glu, parts):  # the staged slab: below the four-value loop's price at four outputs a warp
        assert l.loop_us(KN) < replace(l, per_warp=4).loop_us(KN), l


def test_the_staged_slab_is_the_kernels():
    """gemv_core.cu's slab branch takes the staged tile at one output a warp only, on the staged conditions the
    lane's slab_staged reads (k and the chunk's ends multiples of 256 values, 2048 for q6_k)."""
    core = (KERNELS / "gemv_core.cu").read_text()
    slab = core[core.index("} else if constexpr (SLAB) {"):]
    assert "(fmt == 6 ? 2047 : 255)) == 0" in slab
    assert re.search(r"else if constexpr \(PW == 1\) \{.*?gemv_tile_staged<StagedQ6K, 1, AR>", slab, re.S)
    assert G.STAGED_UNIT == {"q8_0": 256, "q4_0": 256, "q4_k": 256, "q6_k": 2048}
    assert G.slab_staged("q6_k", 4096, 2) and not G.slab_staged("q6_k", 6144, 2)  # chunks of 3072: not 2048's
    assert not G.slab_staged("q8_0", 4096 + 32) and not G.slab_staged("bf16", 4096)
    assert Gemv("x", "w", "q8_0", Dst("y"), 4096 + 32, 4096, 5).tune(KN).per_warp == 4  # gemv_tile_any at four


def test_a_split_slab_and_unaligned_rows():
    # one slab of 4 q8_0 rows split 4 ways: each chunk of 1024 values 8 rounds a warp (64 blocks x 4: one wave)
    g = Gemv("x", "w", "q8_0", Dst("y"), 4096, 256, 4, per_warp=4, split=4)
    assert g.loop_us(KN) == pytest.approx(8 * KN.hbm_round_us)
    # bf16 whose split chunks are not whole 8-value words (4104 / 2: 2052): gemv_tile_any, 17 rounds of 128 values
    s = Gemv("x", "w", "bf16", Dst("y"), 4104, 256, 4, per_warp=4, split=2)
    assert s.loop_us(KN) == pytest.approx(17 * KN.hbm_round_us)
    # k not whole 8-value words: the four-value loop (gemv_tile_any), 33 rounds of 128 values
    u = Gemv("x", "w", "bf16", Dst("y"), 4100, 256, 4, per_warp=4)
    assert u.loop_us(KN) == pytest.approx(33 * KN.hbm_round_us)
    # over a quantized activation (gemv_q8.cu): unpriced here
    q = Gemv("x", "w", "q8_0", Dst("y"), 4096, 256, 4, words=1)
    assert q.loop_us(KN) == 0.0


@pytest.mark.parametrize("m", [3, 8])
def test_the_parts_rope_fold_takes_the_slab_at_four_outputs_a_warp(m):
    """fold_parts_rope's products (parts_rope.cu: gemv_body with the slab's ring at four outputs a warp, without it at
    one, where it spilled) run a slab of bf16 rows through gemv_slab_cp at four — the fold priced by its bytes, as the
    plain parts launch — and through gemv_tile_any at one, priced by that loop's rounds."""
    from lanefuse.kernels import RopeParts, RopeSide

    core = (KERNELS / "parts_rope.cu").read_text()
    assert re.search(r"gemv_body<\(PW > 0 \? PW : 1\), \(PW >= 4\)>", core)
    parts = (GemmPart("wq", Dst("q"), 4096), GemmPart("wk", Dst("kk"), 1024))
    sides = (RopeSide("q", Dst("qr"), 32), RopeSide("kk", Dst("kr"), 8))
    for pw, rounds in ((4, 0), (1, -(-4096 // 128))):
        gp = GemmParts("x", "bf16", 4096, m, parts, per_warp=pw)
        f = Fold(gp, RopeParts(sides, "cos", "sin", "pos", m, 128, 128))
        assert f.fused and f.form()[0] == "parts_rope"
        assert gp.loop_us(KN) == 0.0
        assert f.loop_us(KN) == pytest.approx(rounds * KN.hbm_round_us * -(-(5120 // (4 * pw)) // (KN.sms * 3)))


def test_the_rounds_are_the_knobs():
    """A slab's loop through gemv_tile_any scales with knob hbm_round_us (the launch model's L), as HeadGemv's does;
    one through the staged tile with 1 / l1_tbps."""
    g = Gemv("x", "w", "q4_0", Dst("y"), 4096, 4096, 5, per_warp=4)
    assert g.loop_us(replace(KN, hbm_round_us=2 * KN.hbm_round_us)) == pytest.approx(2 * g.loop_us(KN))
    s = Gemv("x", "w", "q4_0", Dst("y"), 4096, 4096, 5).tune(KN)
    assert s.per_warp == 1 and s.loop_us(replace(KN, l1_tbps=KN.l1_tbps / 2)) == pytest.approx(2 * s.loop_us(KN))
