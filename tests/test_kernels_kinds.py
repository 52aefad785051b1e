"""The registry against the kinds: each kind found once by its census, with a numpy twin and its CUDA sources; its
refusals as Refusal values; its tuning reading only the schedule steps it declares, and those steps together the
lane table's `schedule:`; the kernels each launch makes; what the elementwise base derives."""

from __future__ import annotations

from dataclasses import replace
from importlib import resources

import pytest
import yaml

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels import (KINDS, Advance, ArgMax, Attention, Binary, Chain, Conv, ConvParts, Decay, Delta, Dst, Fold,
                              Gather, GateProj, Gates, GemmPart, GemmParts, GemmTc, GemmTcParts, Gemv, GemvF32, GemvGlu, HeadGemv, Join,
                              L2Norm, Launch, Moe, Norm, NormPair, Part, Quant, Rope, RopeParts, RopeSide, Scale,
                              SetRow, Slice, Softcap, SwiGlu, Unary, View, honoured_steps)
from lanefuse.kernels.attention_tc import AttentionTc
from lanefuse.kernels.collective import Collective
from lanefuse.kernels.conv_parts import ConvPart
from lanefuse.kernels.gemm_blas import BLAS_OF
from lanefuse.lane.lower.knobs import Knobs

# A launch of every kind at its untuned settings (a warp an output, no splits, a head a block).
SAMPLES: dict[str, Launch] = {
    "argmax": ArgMax("x", "o", 100, advance=Advance("tok", "pos")),
    "attention": Attention("q", "kc", "vc", "pos", "o", 8, 4, 64, 64, 4096, 1, 0.125),
    "attention_tc": AttentionTc("q", "kc", "vc", "pos", "o", 32, 4, 128, 128, 4096, 512, 128 ** -0.5),
    "binary": Binary("add", "a", "b", "o", 64, row=16, gate="silu"),
    "conv": Conv("x", "w", "ring", "y", 256, 4, 1, silu=True, l2=128),
    "conv_parts": ConvParts((ConvPart("q", "wq", "rq", "yq", 256, True), ConvPart("v", "wv", "rv", "yv", 512)), 4, 1,
                            block=128),
    "decay": Decay("a", "dt", "al", "y", 32, 32),
    "delta": Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", 16, 32, 128, 128, 1, 128 ** -0.5, 1e-6),
    "fold": Fold(Gemv("x", "w", "f32", Dst("y"), 4096, 4096, 1), Norm("y", "nw", "z", 1, 4096, 1e-6)),
    "chain": Chain((Fold(Gemv("a", "wo", "bf16", Dst("p"), 4096, 4096, 1),
                         Norm("r0", "nw0", "x", 1, 4096, 1e-6, add="p", sum="r")),
                    GemvGlu("x", "wg", "wu", "bf16", "h", 4096, 12288, 1),
                    Fold(Gemv("h", "wd", "bf16", Dst("o"), 12288, 4096, 1),
                         Norm("r", "nw", "z", 1, 4096, 1e-6, add="o", sum="s")))),
    "gate_proj": GateProj("x", "wb", "wa", "bf16", "dt", "al", "b", "g", 2048, 32, 1),
    "gates": Gates("b", "a", "dt", "al", "beta", "g", 32, 32),
    "gather": Gather("E", "t", "e", 64, rows=2, format="bf16", scale=2.0),
    "gemm_parts": GemmParts("x", "f32", 64, 1, (GemmPart("wq", Dst("q"), 4096), GemmPart("wk", Dst("k"), 512))),
    "gemv": Gemv("x", "w", "bf16", Dst("y"), 4096, 64, 1, bias="b"),
    "gemv_f32": GemvF32("x", "w", Dst("y"), 4096, 64, 1),
    "gemm_tc": GemmTc("x", "w", "bf16", Dst("y"), 4096, 4096, 512, bias="b"),
    "gemm_tc_parts": GemmTcParts("x", "bf16", 4096, 512, (GemmPart("wq", Dst("q"), 4096), GemmPart("wk", Dst("k"), 1024))),
    "gemm_tc_glu": KINDS["gemm_tc_glu"]("x", "wg", "wu", "bf16", "o", 4096, 12288, 512),
    "gemm_blas": KINDS["gemm_blas"]("x", "w", "bf16", Dst("y"), 4096, 4096, 512, bias="b"),
    "gemm_blas_parts": KINDS["gemm_blas_parts"]("x", "bf16", 4096, 512, (GemmPart("wq", Dst("q"), 4096),
                                                                         GemmPart("wk", Dst("k"), 1024))),
    "gemm_blas_glu": KINDS["gemm_blas_glu"]("x", "wg", "wu", "bf16", "o", 4096, 12288, 512),
    "gemm_deq": KINDS["gemm_deq"]("x", "w", "q4_k", Dst("y"), 4096, 4096, 512, bias="b"),
    "gemm_deq_parts": KINDS["gemm_deq_parts"]("x", "q8_0", 4096, 512, (GemmPart("wq", Dst("q"), 4096),
                                                                       GemmPart("wk", Dst("k"), 1024))),
    "gemm_deq_glu": KINDS["gemm_deq_glu"]("x", "wg", "wu", "q4_k", "o", 4096, 12288, 512),
    "gemv_glu": GemvGlu("x", "wg", "wu", "f16", "o", 64, 2048, 1),
    "head_gemv": HeadGemv("x", "w", "bf16", Dst("y"), 1, 16, 128, 512, rows_out=False),
    "join": Join("a", "b", Dst("t", row="pos", pitch=24), 1, 2, 8, 4),
    "l2norm": L2Norm("x", "y", 16, 128, 1e-6),
    "moe": Moe("x", "wr", "wgu", "wd", Dst("y"), 64, 37, 8, 2, 1, "bf16"),
    "norm": Norm("x", "w", "o", 2, 64, 1e-6, add="r", sum="s"),
    "norm_pair": NormPair(Norm("qa", "wa", "qn", 1, 1536, 1e-6), Norm("l", "wl", "ln", 1, 512, 1e-6,
                                                                    into=Dst("lc", row="pos", pitch=512))),
    "quant": Quant("x", "xq", 64),
    "rope": Rope("x", "cos", "sin", "pos", Dst("y"), 1, 4, 16, 16),
    "sample": KINDS["sample"]("x", "o", 151936, "p", advance=Advance("tok", "pos")),
    "rope_parts": RopeParts((RopeSide("q", Dst("qr"), 4), RopeSide("k", Dst("kc", row="pos", pitch=16), 1)),
                            "cos", "sin", "pos", 1, 16, 16),
    "scale": Scale("x", "y", 64, 0.5),
    "set_row": SetRow("kc", "k", "pos", 16, 1, 32),
    "slice": Slice("x", "y", 4, 16, 8, 8),
    "softcap": Softcap("x", "y", 64, 30.0),
    "swiglu": SwiGlu("g", "u", "o", 64),
    "unary": Unary("gelu", "x", "y", 64),
    "view": View("x", 16, "v"),
    "collective": Collective("all_reduce", "x", "y", 2, 16, 3),
}


def lane_steps(lane: str = "cuda") -> set[str]:
    path = resources.files("lanefuse.rules").joinpath("lanes", f"{lane}.yaml")
    return set(yaml.safe_load(path.read_text(encoding="utf-8"))["schedule"])


def test_every_kind_has_a_sample():
    assert set(SAMPLES) == set(KINDS)
    assert all(type(SAMPLES[name]) is k for name, k in KINDS.items())


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_has_its_census_numpy_twin_and_sources(name):
    k, l = KINDS[name], SAMPLES[name]
    assert k.census == name
    assert k.numpy is not Launch.numpy, f"{name}: no numpy twin"
    here = resources.files("lanefuse.kernels")
    for s in k.stem:
        assert here.joinpath(f"{s}.cu").is_file(), f"{name}: no {s}.cu"
    if not k.stem:  # no source: a kind that makes no kernel, one that refuses every launch (written later), or one
        # whose launch is a library's call (a collective's communicator)
        assert l.kernels() == () or isinstance(l.check(), Refusal) or getattr(k, "library", "")
    else:
        assert l.check() is None, l.check()


def test_refusals_are_values_in_the_users_words():
    refused = [Quant("x", "xq", 4), Unary("relu", "x", "y", 4), Binary("div", "a", "b", "o", 4), Slice("x", "y", 1, 4, 2, 4),
               SetRow("t", "s", 0, 40, 1, 4, quant="tq", words=1), Gather("E", "t", "e", 4, format="q4"),
               Gemv("x", "w", "f32", Dst("y"), 4, 4, 1, per_warp=2), GemvF32("x", "w", Dst("y"), 0, 4, 1),
               GemmParts("x", "f32", 4, 1, ()), GemvGlu("x", "wg", "wu", "f32", "o", 4, 4, 1, act="relu"),
               Attention("q", "k", "v", "pos", "o", 3, 2, 8, 8, 8, 1, 1.0), Norm("x", "w", "o", 1, 10, 1e-6, heads=3),
               ArgMax("x", "o", 0), Rope("x", "cos", "sin", "pos", Dst("y"), 1, 1, 8, 3),
               RopeParts((), "cos", "sin", "pos", 1, 8, 8),
               Fold(Gather("E", "t", "e", 4, format="q4"), Norm("e", "w", "o", 1, 4, 1e-6)),
               Moe("x", "wr", "wgu", "wd", Dst("y"), 64, 37, 8, 9, 1, "bf16"),
               HeadGemv("x", "w", "q8_0", Dst("y"), 1, 4, 8, 16, rows_out=True),
               Moe("x", "wr", "wgu", "wd", Dst("y"), 64, 37, 8, 2, 1, "bf16", routing="sigmoid_group", groups=3),
               Moe("x", "wr", "wgu", "wd", Dst("y"), 64, 37, 8, 2, 1, "bf16", groups=2, topk_groups=1),
               Moe("x", "wr", "wgu", "wd", Dst("y"), 64, 37, 8, 2, 1, "bf16", format_d="q8_0"),  # 37 in blocks
               Moe("x", "wr", "wgu", "wd", Dst("y"), 64, 37, 8, 2, 1, "bf16", sg="sg"),
               KINDS["sample"]("x", "o", 100, "p", 2, advance=Advance("tok", "pos"))]  # two rows of one sequence
    for l in refused:
        why = l.check()
        assert isinstance(why, Refusal) and why.where == "" and str(why) == why.reason, (l.census, why)
    # a fold that runs as its two kernels says why as a Refusal too
    form, why = Fold(Gemv("x", "w", "f32", Dst("y"), 4096, 64, 1, split=4), SAMPLES["norm"]).form()
    assert form is None and isinstance(why, Refusal) and "split 4 ways" in why.reason
    assert SAMPLES["fold"].form() == ("gemv_norm", None)


def test_tuning_steps_are_the_lane_tables():
    # gemv_parts: a step the lane table takes itself, running merged_qkv as its parts when held; fuse_quant: one the
    # plan takes, holding the rules that join a quantize
    assert honoured_steps() | {"gemv_parts", "fuse_quant"} == lane_steps("cuda")
    assert all(set(k.steps) <= lane_steps("cuda") for k in KINDS.values())


# Launches the schedule changes under the default knobs: four rows a warp, split-K, heads a block and splits.
TUNED = [Gemv("x", "w", "f32", Dst("y"), 4096, 4096, 1), Gemv("x", "w", "f32", Dst("y"), 4096, 64, 1),
         SAMPLES["gemm_parts"], SAMPLES["gemv_glu"], SAMPLES["attention"],
         Fold(Gemv("x", "w", "f32", Dst("y"), 4096, 64, 1), SAMPLES["norm"]), SAMPLES["fold"]]


@pytest.mark.parametrize("launch", list(SAMPLES.values()) + TUNED, ids=lambda l: l.census)
def test_tune_reads_only_the_steps_its_kind_declares(launch):
    knobs = Knobs()
    every = frozenset(lane_steps("cuda"))
    tuned = launch.tune(knobs, frozenset())
    # the schedule keeps a launch runnable, of its kind (the `cublas` step: a tensor-core product's cuBLAS form)
    assert type(tuned) in (type(launch), BLAS_OF.get(type(launch))) and tuned.check() == launch.check()
    assert launch.tune(knobs, every) == launch  # every step held: the untuned settings
    if isinstance(launch, (Fold, Chain)):
        return  # a fold's (a chain's) steps are its pair's
    assert launch.tune(knobs, every - set(launch.steps)) == tuned
    if not launch.steps:
        assert tuned == launch


def test_tune_fills_the_schedules_settings():
    k = Knobs()
    assert TUNED[0].tune(k) == replace(TUNED[0], per_warp=4)  # wide: four rows a warp
    assert TUNED[1].tune(k) == replace(TUNED[1], split=8)  # 16 blocks on 132 SMs: k in 8 splits of 512
    assert TUNED[1].tune(k, {"split_k"}) == TUNED[1]
    assert SAMPLES["gemm_parts"].tune(k).per_warp == 4 and SAMPLES["gemv_glu"].tune(k).per_warp == 4
    a = SAMPLES["attention"].tune(k)
    assert (a.per_block, a.splits) == (4, 64)  # 2 blocks for 264 (2 an SM); 4096 positions in splits of at least 64
    f = TUNED[5].tune(k)
    assert f.first.split == 1 and f.fused  # the fold's last block norms the whole product: no split-K


def test_kernels_a_launch_makes():
    assert View("x", 0, "v").kernels() == ()
    assert SAMPLES["gemv"].kernels() == (SAMPLES["gemv"],)
    m = SAMPLES["moe"]
    assert len(m.kernels()) == 2 and len(replace(m, sort=True).kernels()) == 4  # a row at a time; sorted rows
    for l in (m, replace(m, sort=True, rows=8)):  # each kernel costed by its share
        assert sum(k.bytes() for k in l.kernels()) == l.bytes() and sum(k.flops() for k in l.kernels()) == l.flops()
    fused = SAMPLES["fold"]
    assert fused.fused and fused.kernels() == (fused,)
    two = Fold(SAMPLES["gemv_glu"], Norm("o", "nw", "y", 1, 2048, 1e-6))
    assert not two.fused and two.kernels() == (two.first, two.then)


def test_elementwise_kinds_derive_reads_writes_and_grid():
    j = SAMPLES["join"]
    assert j.reads() == ("a", "b", "pos") and j.writes() == ("t",)
    assert j.grid_block() == ((1, 1, 1), (256, 1, 1))
    assert SAMPLES["set_row"].reads() == ("k", "pos") and SAMPLES["set_row"].writes() == ("kc",)
    assert SetRow("kc", "k", 3, 16, 1, 32).reads() == ("k",)  # a fixed row reads no parameter
    assert SAMPLES["binary"].reads() == ("a", "b") and SAMPLES["binary"].writes() == ("o",)
    assert SwiGlu("g", "g", "o", 5000).reads() == ("g",) and SwiGlu("g", "u", "o", 5000).grid_block()[0] == (20, 1, 1)
    assert Slice("x", "y", 4, 16, 8, 8).grid_block() == ((1, 1, 1), (256, 1, 1))
    assert Join("a", "b", Dst("y", unit=Part(12, 0, 12)), 1, 1, 8, 4).reads() == ("a", "b")
