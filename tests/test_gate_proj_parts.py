"""GateProj `parts` (issue 40 item 4, seed 002's GateProj `parts`): a gated delta net's gate products in `parts` warps a
(row, head), each a part of k, added in the block in part order (gate_proj.cu; the schedule's `split_k`). The real
kernel run by the host emulator of CUDA against the numpy twin (parts 1, 2, 4; dense and block formats; k not a
multiple of the parts or of 32; heads not filling the last block), again in reverse block order with shuffled threads
(the same bits); the step's choice and refusals; a tiny Qwen3-Next's decode and chunk (gemv_parts held, so the gate
products take their own launch) in parts, its tokens and logits the reference interpreter's."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import test_kernels_gpu as gpu
from cuda_host import emu
from test_kernels_emulated import again_same
from lanefuse.kernels import GateProj
from lanefuse.kernels.common import encode
from lanefuse.lane.lower.knobs import Knobs

needs_gxx = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")


@pytest.fixture(scope="module")
def emulated():
    with emu.emulating([GateProj.stem]) as env:
        yield env


@needs_gxx
@pytest.mark.parametrize("fmt,k", [("f32", 7), ("bf16", 300), ("f16", 2048), ("q8_0", 544), ("q4_k", 512)])
@pytest.mark.parametrize("rows,heads", [(1, 5), (3, 4), (1, 32)])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_parts_equal_the_twin(emulated, fmt, k, rows, heads, parts):
    g = np.random.default_rng(k + rows + heads + parts)
    w = {"wb": (encode(gpu.r32(g, heads, k) / np.sqrt(k), fmt), fmt),
         "wa": (encode(gpu.r32(g, heads, k) / np.sqrt(k), fmt), fmt),
         "dt": (gpu.r32(g, heads), "f32"), "al": (gpu.r32(g, heads), "f32")}
    arrays = {"x": gpu.r32(g, rows * k), "beta": np.zeros(rows * heads, np.float32),
              "dec": np.zeros(rows * heads, np.float32)}
    launch = GateProj("x", "wb", "wa", fmt, "dt", "al", "beta", "dec", k, heads, rows, parts=parts)
    dev = gpu.both(launch, arrays, w, tol=2e-5)
    assert [c[0] for c in dev.calls] == ["gate_proj"] and launch.grid_block()[0][0] == -(-rows * heads * parts // 4)
    again_same(launch, dev, ["beta", "dec"])


def test_the_step_takes_parts_where_the_blocks_leave_the_chip_idle():
    """`split_k`: Qwen3-Next-80B's decode (32 value heads, k 2048: 8 blocks of one part) takes 4; a 64-row chunk
    (512 blocks already) 1; k 256 (parts of at least 128 values) 2; held, 1; the dependent loads a lane cut 4x."""
    knobs = Knobs()
    def tuned(k, heads, rows, held=frozenset()):
        return GateProj("x", "wb", "wa", "bf16", "dt", "al", "b", "d", k, heads, rows).tune(knobs, held)
    decode = tuned(2048, 32, 1)
    assert decode.parts == 4 and decode.rounds() == 16 and dataclasses.replace(decode, parts=1).rounds() == 64
    assert (tuned(2048, 32, 64).parts, tuned(256, 32, 1).parts, tuned(64, 4, 1).parts) == (1, 2, 1)
    assert tuned(2048, 32, 1, held={"split_k"}).parts == 1
    assert decode.bytes() == dataclasses.replace(decode, parts=1).bytes()  # no byte more: the same rows read once
    why = dataclasses.replace(decode, parts=3).check()
    assert "3 parts" in str(why) and "1, 2, 4" in str(why)


# -- reached from a real front: a tiny Qwen3-Next whose gate products take their own launch (gemv_parts held) --------

def tiny_qwen3next(bf16: bool):
    transformers = pytest.importorskip("transformers")
    from lanefuse.engine.front.hfconfig import config_from_hf
    from lanefuse.engine.front.weights import Weights, f32_to_bf16

    base = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=40, vocab_size=97, linear_conv_kernel_dim=4, linear_key_head_dim=32,
                linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0,
                max_position_embeddings=128, layer_types=["linear_attention", "full_attention"])
    c = json.loads(transformers.Qwen3NextConfig(**base).to_json_string())
    c["architectures"] = ["Qwen3NextForCausalLM"]
    cfg = config_from_hf(c)
    rng = np.random.default_rng(7)
    arrays = {}
    for name, shape in cfg.weight_names().items():
        if name.endswith("A_log"):  # slow and fast forgetting heads
            a = np.log(rng.uniform(0.05, 2.0, shape))
        elif len(shape) == 1:
            a = 0.1 * rng.standard_normal(shape) + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        arrays[name] = a.astype(np.float32)
    if bf16:
        names = tuple(n for n, a in arrays.items() if ".layers." in n and np.ndim(a) == 2)
        cfg = dataclasses.replace(cfg, formats=tuple((n, "bf16") for n in names))
        for n in names:
            arrays[n] = f32_to_bf16(arrays[n])
    return cfg, Weights.from_dict(arrays, cfg)


@pytest.mark.parametrize("bf16", [False, True])
def test_a_tiny_qwen3next_runs_its_gate_products_in_parts(bf16):
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import PlanOptions, plan
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.step import plan_step_fn

    cfg, w = tiny_qwen3next(bf16)
    for rows in (1, 4):
        on = plan(build_step(cfg, rows), held=["gemv_parts"])
        off = plan(build_step(cfg, rows), held=["gemv_parts", "split_k"])
        gp = [x.launch for x in on.launches if x.launch.census == "gate_proj"]
        assert gp and {x.parts for x in gp} == {4} and on.n_launches == off.n_launches
        assert {x.launch.parts for x in off.launches if x.launch.census == "gate_proj"} == {1}
    assert "gate_proj" not in plan(build_step(cfg, 1)).census  # by default the products ride the GEMV in parts
    prompt = [3, 17, 5, 42, 8, 11, 60, 2, 29]  # chunks of 4, 4 and 1

    def run(held):
        fn, _ = plan_step_fn(w, "cpu", PlanOptions(held=held), exact=True)
        return generate(cfg, w, prompt, 4, step_fn=fn, chunk=4)

    got, one, ref = run(("gemv_parts",)), run(("gemv_parts", "split_k")), generate(cfg, w, prompt, 4, chunk=4)
    assert got.generated_ids == one.generated_ids == ref.generated_ids
    for x, y, z in zip(got.logits, one.logits, ref.logits):
        scale = float(np.abs(z).max())
        assert np.abs(np.asarray(x, np.float64) - z).max() <= 1e-4 * scale
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6 * scale)
