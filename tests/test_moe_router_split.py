"""Moe `router_split` (issue 40 item 4, seed 002's Moe `router_split`; the schedule's `router_split`): a mixture a row
at a time routes each row ONCE, as phase 0 of its launch (moe.cu moe_up_split), where moe_up's every block computes
the row's E router logits and its choice. Blocks take tickets as kernels/chain.cu's do: the first tickets compute a
part of a row's logits each, the last of a row's to arrive chooses; the shared expert's tiles come next and wait on
nothing; each choice's tiles wait until their row is routed, then read their expert from `choices`.

The real kernels run by the host emulator of CUDA against the numpy twin, with the launch's scratch NaN / -1 before
it runs (as a device's memory holds what it held): f32, bf16, q8_0, q4_k, a shared expert (and the q8 numerics' one),
gpt-oss's biases and clamp, DeepSeek-V3's grouped routing, a rank's part, 1 and 3 rows; the same bits as router_split
1; the counters back at zero; a relaunch in reverse block order with shuffled threads the same bits. The emulator
runs blocks one after another, so a wait not met at once is never met (the poll is bounded and traps). Mutations: the
phase by blockIdx in reverse order traps in the wait; with the wait gone too, the choices' blocks read a routing not
yet written and the values are wrong. (The wait alone removed cannot show here: in ticket order every router block
has finished before the first choice's block runs.) Then the step's choice and refusals, and tiny Qwen3-MoE / Mixtral
decodes planned with it: the reference interpreter's tokens, the plan's own mixture launch run by the emulator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import test_kernels_gpu as gpu
from cuda_host import emu
from lanefuse.kernels import Dst, Moe
from lanefuse.lane.lower.knobs import Knobs
from test_kernels_emulated import again_same, counters_zero
from test_ranks_moe_emulated import poisoned  # scratch NaN / -1 / 0xff before the launch: a read before a write shows
from test_moe_per_warp import emulated, mixture, needs_gxx  # noqa: F401 - the emulator fixture
from test_ranks_moe_emulated import part_of

r32 = gpu.r32


def run_split(launch: Moe, arrays: dict, weights: dict, split: int) -> dict:
    """The launch at router_split `split` (poisoned scratch) against the twin; its kernels, counters, a reverse
    relaunch; its outputs."""
    s = dataclasses.replace(launch, router_split=split)
    assert s.check() is None, s.check()
    dev = poisoned(s, arrays, weights)
    assert [c[0] for c in dev.calls] == ["moe_up_split" if split > 1 else "moe_up", "moe_down"]
    counters_zero(s, dev)
    outs = [n for n in ("y", "s") if n in arrays]
    again_same(s, dev, outs)
    return {n: dev.host(n).copy() for n in outs}


CASES = [  # fmt, rows, d, f, E, k, shared, finalize, gptoss, qwords, per_warp, split
    ("f32", 1, 32, 37, 40, 3, 0, False, False, 0, 4, 2),  # two router blocks of 20 and 20 logits
    ("bf16", 3, 64, 40, 37, 4, 40, True, False, 0, 4, 3),  # 3 rows, a shared expert, the finalize; parts 13/13/11
    ("bf16", 1, 64, 72, 24, 2, 0, True, True, 0, 1, 3),  # gpt-oss's router and expert biases, its clamp
    ("q8_0", 1, 128, 96, 20, 2, 64, True, False, 1, 1, 3),  # the q8 numerics' shared expert beside the split
    ("q4_k", 1, 256, 256, 12, 2, 256, False, False, 3, 4, 12),  # q4_k rows, a logit a router block
]


@needs_gxx
@pytest.mark.parametrize("fmt,rows,d,f,E,k,shared,finalize,gptoss,qwords,per_warp,split", CASES)
def test_the_routing_split_equals_the_twin_and_one_router_a_block(emulated, fmt, rows, d, f, E, k, shared, finalize,
                                                                   gptoss, qwords, per_warp, split):
    launch, arrays, weights = mixture(fmt, rows, d, f, E, k, shared, finalize, gptoss, qwords)
    launch = dataclasses.replace(launch, per_warp=per_warp)
    one = run_split(launch, arrays, weights, 1)
    got = run_split(launch, arrays, weights, split)
    for n in got:
        np.testing.assert_array_equal(got[n], one[n], err_msg=n)


@needs_gxx
def test_grouped_routing_and_a_ranks_part_split(emulated):
    """DeepSeek-V3's grouped routing (8 groups of 4, 3 kept, a shared expert; its group scores in shared memory now)
    at router_split 1 and 4; then a rank's part of a mixture (experts 2..4 of 9 held, every row routed over all 9):
    the choices of other ranks' experts are -1 in `choices` and their blocks compute nothing."""
    launch, arrays, weights = gpu.grouped_moe(2, 64, 40, 32, 4, 8, 3, 24, seed=2 + 64 + 32)  # DeepSeek-V3's routing
    one, four = run_split(launch, arrays, weights, 1), run_split(launch, arrays, weights, 4)
    np.testing.assert_array_equal(four["y"], one["y"])
    whole, arrays, weights = mixture("bf16", 2, 64, 40, 9, 3)
    part, cut = part_of(dataclasses.replace(whole, per_warp=1), weights, 2, 5)
    one, two = run_split(part, arrays, cut, 1), run_split(part, arrays, cut, 2)
    np.testing.assert_array_equal(two["y"], one["y"])


# -- what the ticket does: each a mutated moe.cu ----------------------------------------------------------------------

BY_BLOCK = ("const i64 t = ticket, routers", "const i64 t = blockIdx.x, routers")
NO_WAIT = ("chain_wait(counters + 2 + rows + r, 1u);", "")


def _mutated_reverse(monkeypatch, *pairs):
    """moe.cu with `pairs` replaced, built into a fresh emulated module, its split launch run once in reverse block
    order with shuffled threads against the twin."""
    from lanefuse.kernels import compile as kc
    from lanefuse.kernels import cupy_env

    text = kc.cu_text("moe")
    for old, new in pairs:
        assert old in text, f"moe.cu no longer holds {old!r}: update the mutation"
        text = text.replace(old, new)
    real = kc.cu_text
    monkeypatch.setattr(kc, "cu_text", lambda stem: text if stem == "moe" else real(stem))
    init = cupy_env.DeviceEnv.__init__

    def reverse(self, *a, **kw):
        init(self, *a, **kw)
        self.flags, self.seed = 1, 7

    monkeypatch.setattr(cupy_env.DeviceEnv, "__init__", reverse)
    launch, arrays, weights = mixture("bf16", 2, 64, 40, 37, 3, 24)
    with emu.emulating([Moe.stem]):
        poisoned(dataclasses.replace(launch, per_warp=4, router_split=2), arrays, weights)


@needs_gxx
@pytest.mark.forked
def test_phase_by_block_index_traps_in_the_bounded_wait(monkeypatch):
    """Blocks in reverse order, the phase by blockIdx: the first block to run is a choice's whose row's router blocks
    have not run; its wait is never met (on a device with too few resident blocks, a hang): the emulator traps."""
    with pytest.raises(RuntimeError, match="trap"):
        _mutated_reverse(monkeypatch, BY_BLOCK)


@needs_gxx
@pytest.mark.forked
def test_phase_by_block_index_without_the_wait_reads_no_routing(monkeypatch):
    with pytest.raises(AssertionError):
        _mutated_reverse(monkeypatch, BY_BLOCK, NO_WAIT)


@needs_gxx
def test_by_ticket_in_reverse_block_order_is_right(monkeypatch):
    """The real kernel under the mutations' harness: tickets, not block indices, order the phases."""
    _mutated_reverse(monkeypatch)


# -- the schedule step ------------------------------------------------------------------------------------------------

def shape(d: int, f: int, E: int, k: int, rows: int = 1, **kw) -> Moe:
    return Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, "bf16", **kw)


def test_the_step_splits_where_a_block_routing_whole_takes_more_than_one_round():
    """`router_split`: Qwen3-30B-A3B's mixture (128 experts over 2048, four logits a warp) makes 4 rounds of a warp's
    router dots in each of its 96 blocks: split in 4 (a round each); DeepSeek-V3's 256: 8; Qwen2-MoE's 60: 2;
    Mixtral's 8 and gpt-oss-20b's 32 take one round whole: 1. Narrow experts (one logit a warp): E / 8 rounds. Held,
    over sorted rows: 1. Bytes and the kernel count unchanged."""
    knobs = Knobs()
    cases = [((2048, 768, 128, 8), 4), ((7168, 2048, 256, 8), 8), ((2048, 1408, 60, 4), 2), ((4096, 14336, 8, 2), 1),
             ((2880, 2880, 32, 4), 1), ((64, 24, 40, 2), 5)]
    for (d, f, E, k), want in cases:
        base = shape(d, f, E, k)
        t = base.tune(knobs)
        assert t.router_split == want, (d, f, E, k, t.router_split)
        assert t.check() is None and t.bytes() == base.bytes() and len(t.kernels()) == len(base.kernels())
    big = shape(2048, 768, 128, 8)
    assert big.tune(knobs, {"router_split"}).router_split == 1
    assert big.tune(knobs, {"rows_a_warp"}).router_split == 16  # one logit a warp: 16 rounds whole
    assert shape(2048, 768, 128, 8, rows=9, sort=True).tune(knobs).router_split == 1


@pytest.mark.parametrize("kw,words", [
    (dict(sort=True, rows=9, router_split=4), "sorted rows"),
    (dict(router_split=200), "128 experts split in 200 blocks"),
    (dict(router_split=0), "split in 0 blocks"),
])
def test_what_the_split_refuses_in_one_line(kw, words):
    why = shape(2048, 768, 128, 8, **kw).check()
    assert why is not None and words in str(why) and "\n" not in str(why)


# -- planned from a model ---------------------------------------------------------------------------------------------

MODELS = [("Qwen3MoeForCausalLM", dict(experts=40, k=3), "f32", 2),  # 40 experts, four logits a warp: 2 rounds
          ("MixtralForCausalLM", dict(experts=12, inter=20), "bf16", 2)]  # experts of 20: a logit a warp, 12 / 8


@pytest.mark.parametrize("arch,moe,fmt,split", MODELS, ids=[m[0] for m in MODELS])
def test_a_tiny_mixtures_decode_routes_once_a_row(arch, moe, fmt, split):
    """The decode plan of a tiny mixture splits every mixture's routing, held none; its logits and caches the
    reference interpreter's (test_moe's check), and greedy tokens through the exact twins equal the reference
    interpreter's with the step on and held (the same launch count). The plan's own mixture launch, run by the
    emulator against the twin, equals it at router_split 1 to the bit."""
    from lanefuse.lane.lower.plan import PlanOptions
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.step import plan_step_fn
    from test_moe import plan_against_reference, tiny, weights_for

    cfg = tiny(arch, **moe)
    w = weights_for(cfg, fmt)
    s = plan_against_reference(cfg, w, 1)
    moes = [x.launch for x in s.launches if x.launch.census == "moe"]
    assert moes and {m.router_split for m in moes} == {split}
    held = plan_against_reference(cfg, w, 1, held=["router_split"])
    assert {x.launch.router_split for x in held.launches if x.launch.census == "moe"} == {1}
    assert held.n_launches == s.n_launches
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, cfg.vocab, 4)]

    def run(hold):
        fn, _ = plan_step_fn(w, "cpu", PlanOptions(held=hold), exact=True)
        return generate(cfg, w, prompt, 4, step_fn=fn, chunk=8)

    on, off, ref = run(()), run(("router_split",)), generate(cfg, w, prompt, 4, chunk=8)
    assert on.generated_ids == off.generated_ids == ref.generated_ids
    if emu.compiler() is None:
        return
    from lanefuse.lane.run.constants import host_matrix

    m = moes[0]
    g = np.random.default_rng(11)
    arrays = {n: r32(g, m.rows, m.d) for n in {m.x, m.add} - {None}}
    arrays.update({n: np.zeros(m.rows * m.d, np.float32) for n in {m.out.buf, m.sum} - {None}})
    # the plan's formats are its graph's (f32: the runner reads the checkpoint's rows decoded), so its values are
    weights = {n: (np.asarray(host_matrix(s.constants[n], w), np.float32).reshape(-1), "f32") for n in m.weights()}
    plain = dataclasses.replace(m, out=Dst(m.out.buf))  # its own buffers, not the arena's views
    with emu.emulating([Moe.stem]):
        got, one = run_split(plain, arrays, weights, split), run_split(plain, arrays, weights, 1)
    for n in got:
        np.testing.assert_array_equal(got[n], one[n], err_msg=n)


# -- the launch model's pricing (bench/launch_model.py: every figure a PREDICTION) ------------------------------------

def test_the_launch_model_prices_one_router_round_on_the_split_path():
    """Qwen3-30B-A3B's mixture a row at a time: each of moe_up's blocks makes 4 router dots a warp before its tile's
    4 gate/up dots, moe_up_split's one (phase 0) and the poll at the boundary; each kernel recorded once per launch
    (a stage launches its own kernel alone); the bytes equal."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import launch_model as lm

    def recorded(m):
        env = lm.recording_env()({})
        out = []
        for stage in m.kernels():
            e = env.__class__({})
            stage.cuda(e)
            assert len(e.calls) == 1, [c.name for c in e.calls]
            out.append(lm.Kernel(0, m.census, stage, e.calls[0]))
        return out

    knobs = Knobs()
    split = shape(2048, 768, 128, 8).tune(knobs)
    whole = shape(2048, 768, 128, 8).tune(knobs, {"router_split"})
    (up_s, down_s), (up_w, down_w) = recorded(split), recorded(whole)
    names = [k.call.name for k in (up_s, up_w, down_s, down_w)]
    assert names == ["moe_up_split", "moe_up", "moe_down", "moe_down"]
    for k in (up_s, up_w):
        lm.moe_up_structure(k)
    dot = 2048 // (32 * lm.MOE_UNROLL)
    assert (up_w.extra["router_rounds"], up_s.extra["router_rounds"]) == (4 * dot, dot)
    assert up_w.extra["glu_rounds"] == up_s.extra["glu_rounds"] == 4 * dot and up_s.bytes == up_w.bytes
    assert up_s.call.grid == (4 + 12 * 8, 1, 1) and up_w.call.grid == (12, 8, 1)
