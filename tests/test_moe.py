"""Expert mixtures (issue 19): the `moe` op's meaning against transformers (Qwen3-MoE, Mixtral, Qwen2-MoE; f32 and
bf16; the 4.x per-expert and the 5.x fused spellings of the experts), the Moe launch's twins against the reference
(a row at a time and over sorted rows, a shared expert, the finalize, chunks where most experts are chosen and where
some expert is chosen by none), and the fused plan in the numpy arena against transformers, its classes alone and
held."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from hf_ref import fused_step, hf_greedy, margins_ok, scaled_error
from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import OP_IMPL
from lanefuse.engine.routing import route
from lanefuse.kernels import Dst, HostEnv, Moe
from lanefuse.kernels.common import encode

SENTINEL = -777.0
TOL = 1e-4


def r32(g, *shape, scale=1.0):
    return (scale * g.standard_normal(shape)).astype(np.float32)


# -- the routing ------------------------------------------------------------------------------------------------------

def test_route_softmax_topk_renormalized_and_ties_to_the_lower_expert():
    logits = np.array([[0.0, 2.0, 1.0, 2.0, -1.0]])
    chosen, w = route(logits, 3, norm_topk=False)
    assert chosen.tolist() == [[1, 3, 2]]  # 1 and 3 tie: the lower first
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(w[0], p[[1, 3, 2]])
    _, wn = route(logits, 3, norm_topk=True)
    np.testing.assert_allclose(wn[0], p[[1, 3, 2]] / p[[1, 3, 2]].sum())


def test_route_as_torch_topk():
    """Distinct probabilities: torch.topk's choices in its order. (Among exactly equal probabilities torch.topk's
    order is unspecified — its CPU partial sort returns [6, 5] of eight zeros — so the stated rule is ours: the
    lower expert first, as the kernels choose.)"""
    torch = pytest.importorskip("torch")
    g = np.random.default_rng(3)
    logits = g.standard_normal((64, 16))
    p = torch.softmax(torch.tensor(logits), dim=-1)
    _, want = torch.topk(p, 4, dim=-1)
    chosen, _ = route(logits, 4, norm_topk=False)
    assert chosen.tolist() == want.tolist()


# -- the launch's twins against the reference ---------------------------------------------------------------------

def mixture(g, rows, d, f, E, k, fmt="f32", shared=0, finalize="", unchosen=()):
    """(launch fields, arrays, weights, the reference's result) of a random mixture; experts in `unchosen` get a
    router row no positive input picks."""
    x = np.abs(r32(g, rows, d)) if unchosen else r32(g, rows, d)
    wr = r32(g, E, d, scale=3 / np.sqrt(d))
    for e in unchosen:
        wr[e] = -np.abs(wr[e]) - 1.0
    wgu, wd = r32(g, E * 2 * f, d, scale=1 / np.sqrt(d)), r32(g, E * d, f, scale=1 / np.sqrt(f))
    q = lambda a: np.asarray(__import__("lanefuse.kernels.common", fromlist=["decode"]).decode(encode(a, fmt), fmt))
    weights = {"wr": (wr, "f32"), "wgu": (encode(wgu, fmt), fmt), "wd": (encode(wd, fmt), fmt)}
    ref = OP_IMPL["moe"](x, wr, q(wgu), q(wd), experts=E, k=k, inter=f, norm_topk=True)
    kw = {}
    if shared:
        sg, su = r32(g, shared, d, scale=1 / np.sqrt(d)), r32(g, shared, d, scale=1 / np.sqrt(d))
        sd, sgt = r32(g, d, shared, scale=1 / np.sqrt(shared)), r32(g, 1, d, scale=1 / np.sqrt(d))
        weights.update({"sg": (encode(sg, fmt), fmt), "su": (encode(su, fmt), fmt), "sd": (encode(sd, fmt), fmt),
                        "sgt": (encode(sgt, fmt), fmt)})
        sg, su, sd, sgt = map(q, (sg, su, sd, sgt))
        x64 = x.astype(np.float64)
        h = OP_IMPL["swiglu"](x64 @ sg.T, x64 @ su.T)
        ref = ref + (h.astype(np.float64) @ sd.T) / (1 + np.exp(-(x64 @ sgt.T)))
        kw.update(sg="sg", su="su", sd="sd", sgate="sgt", sf=shared, format_s=fmt)
    arrays = {"x": x.reshape(-1), "y": np.full(rows * d, SENTINEL, np.float32)}
    if finalize:  # "add": the residual added; "norm": added, the sum kept and normed
        a, nw = r32(g, rows, d), (1 + 0.1 * r32(g, d)).astype(np.float32)
        arrays.update(a=a.reshape(-1))
        ref = a + ref
        kw.update(add="a")
    if finalize == "norm":
        arrays.update(s=np.full(rows * d, SENTINEL, np.float32))
        weights["nw"] = (nw, "f32")
        ref = (ref / np.sqrt(np.mean(ref * ref, axis=-1, keepdims=True) + 1e-6) * nw, ref)
        kw.update(sum="s", nw="nw", eps=1e-6)
    fields = dict(x="x", wr="wr", wgu="wgu", wd="wd", out=Dst("y"), d=d, f=f, experts=E, k=k, rows=rows, format=fmt,
                  format_r="f32", norm_topk=True, **kw)
    return fields, arrays, weights, ref


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("rows,sort", [(1, False), (5, False), (16, True)])
@pytest.mark.parametrize("shared,finalize", [(0, ""), (40, ""), (0, "norm"), (24, "norm"), (0, "add"), (24, "add")])
@pytest.mark.parametrize("twin", ["numpy", "fast"])
def test_moe_twins_against_the_reference(fmt, rows, sort, shared, finalize, twin):
    g = np.random.default_rng(zlib.crc32(f"{fmt}{rows}{shared}{finalize}".encode()))
    fields, arrays, weights, ref = mixture(g, rows, 32, 37, 8, 2, fmt, shared, finalize)
    launch = Moe(**fields, sort=sort)
    assert launch.check() is None
    env = HostEnv(arrays, weights)
    getattr(launch, twin)(env)
    want = ref[0] if finalize == "norm" else ref
    got = env.array("y").reshape(rows, 32)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * float(np.abs(want).max()))
    if finalize == "norm":
        np.testing.assert_allclose(env.array("s").reshape(rows, 32), ref[1], rtol=TOL, atol=TOL)


def test_a_chunk_choosing_most_experts_and_one_choosing_none_of_some():
    g = np.random.default_rng(5)
    for unchosen in ((), (3, 6)):
        fields, arrays, weights, ref = mixture(g, 24, 32, 37, 8, 2, "bf16", unchosen=unchosen)
        chosen, _ = route(arrays["x"].reshape(24, 32).astype(np.float64) @ weights["wr"][0].T.astype(np.float64),
                          2, True)
        used = set(chosen.reshape(-1).tolist())
        if unchosen:
            assert not used & set(unchosen) and len(used) >= 4
        else:
            assert len(used) >= 7  # rows for (nearly) every expert
        for sort in (False, True):
            launch = Moe(**fields, sort=sort)
            for twin in ("numpy", "fast"):
                env = HostEnv({k: v.copy() for k, v in arrays.items()}, weights)
                getattr(launch, twin)(env)
                np.testing.assert_allclose(env.array("y").reshape(24, 32), ref, rtol=TOL,
                                           atol=TOL * float(np.abs(ref).max()))
        # bytes: sorted rows read each chosen expert once, a row at a time each row's choices
        assert Moe(**fields, sort=True).bytes() < Moe(**fields).bytes()


@pytest.mark.parametrize("fmt,d,f", [("q8_0", 64, 96), ("q4_0", 32, 64), ("q4_k", 256, 256), ("q6_k", 256, 512)])
@pytest.mark.parametrize("rows,sort", [(1, False), (9, True)])
def test_moe_twins_on_block_formats(fmt, d, f, rows, sort):
    """Experts in the GGUF block formats, read in place (rows of whole blocks); rows not whole blocks are refused."""
    g = np.random.default_rng(d + f)
    fields, arrays, weights, ref = mixture(g, rows, d, f, 4, 2, fmt, 0, "add")
    launch = Moe(**fields, sort=sort)
    assert launch.check() is None
    for twin in ("numpy", "fast"):
        env = HostEnv({k: v.copy() for k, v in arrays.items()}, weights)
        getattr(launch, twin)(env)
        np.testing.assert_allclose(env.array("y").reshape(rows, d), ref, rtol=TOL, atol=TOL * float(np.abs(ref).max()))
    odd = Moe(**{**fields, "f": 37})
    assert "block" in str(odd.check())


def test_moe_reads_only_the_chosen_experts_rows():
    """The decode launch's bytes are the router and k experts' rows, not all E."""
    m = Moe("x", "wr", "wgu", "wd", Dst("y"), 2048, 768, 128, 8, 1, "bf16", format_r="bf16")
    experts = 8 * 3 * 768 * 2048 * 2
    assert experts < m.checkpoint_bytes() < m.bytes() < experts + 128 * 2048 * 2 + 4 * (4 * 2048 + 2 * 8 * 768)


# -- transformers -----------------------------------------------------------------------------------------------------

PROMPT = [3, 17, 5, 42, 8, 11, 29, 2, 51, 13, 7, 33, 19, 40, 23, 9, 61, 14]  # 18: chunks of 8, 8 and 2
N_TOKENS = 12
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=37, vocab_size=64, max_position_embeddings=128)
CASES = {  # name: (config class, config kwargs)
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=37,
                                         norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen3_moe_unnormed": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=20,
                                                  norm_topk_prob=False, decoder_sparse_step=2)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "mixtral_window": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=37,
                                         shared_expert_intermediate_size=40, norm_topk_prob=False)),
    # use_sliding_window: Qwen3-MoE slides every layer, Qwen2-MoE its even layers before max_window_layers
    "qwen3_moe_window": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
                                                norm_topk_prob=True, use_sliding_window=True, sliding_window=5)),
    "qwen2_moe_window": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
                                                shared_expert_intermediate_size=24, norm_topk_prob=True,
                                                num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                                                max_window_layers=3)),
}
SALT = 1


def build(name: str, dtype: str, folder):
    """A transformers-made tiny model saved with save_pretrained in `dtype` (4.x per-expert spelling, as 5.24 writes
    it), and transformers' own model of the saved weights in f32 (eager experts: its grouped kernel wants strides of
    16 bytes)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cls, kw = CASES[name]
    cfg = getattr(transformers, cls)(**{**SMALL, **kw})
    model_cls = getattr(transformers, cls.replace("Config", "ForCausalLM"))
    torch.manual_seed(zlib.crc32(name.encode()) + SALT)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # scales that keep the residual alive and the routing decisive; every 1-D weight perturbed
        for pname, p in model.named_parameters():
            if p.dim() == 1 or "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.1 * torch.randn_like(p))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):
                p.copy_(3 * torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    ref = model_cls.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager").eval()
    return ref


def fuse_experts(folder, cfg_name: str):
    """Rewrite a saved checkpoint in the fused spelling transformers 5 holds in memory: per layer
    `mlp.experts.gate_up_proj` (E, 2f, d) and `mlp.experts.down_proj` (E, d, f) (Mixtral's router as `mlp.gate`)."""
    import re

    from safetensors.numpy import load_file, save_file

    t = load_file(str(folder / "model.safetensors"))
    out, experts = {}, {}
    pat = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
    for name, a in t.items():
        m = pat.fullmatch(name)
        if m:
            role = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m.group(3), m.group(3))
            experts.setdefault(int(m.group(1)), {}).setdefault(role, {})[int(m.group(2))] = a
        else:
            out[name.replace("block_sparse_moe.gate.", "mlp.gate.")] = a
    for layer, roles in experts.items():
        E = len(roles["gate_proj"])
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = np.stack([np.concatenate([roles["gate_proj"][e], roles["up_proj"][e]])
                                            for e in range(E)])
        out[p + "down_proj"] = np.stack([roles["down_proj"][e] for e in range(E)])
    (folder / "model.safetensors").unlink()
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})


PARITY = [(n, d) for n in CASES for d in ("float32", "bfloat16")]


@pytest.mark.hf
@pytest.mark.parametrize("name,dtype", PARITY, ids=[f"{n}-{d}" for n, d in PARITY])
def test_hf_parity_reference_and_fused_plan(name, dtype, tmp_path):
    """The reference interpreter of the lifted graph and the fused plan in the numpy arena (exact twins) against
    transformers: the same greedy tokens, logits within 1e-4 of their scale, prefill chunks of 8 rows then decode."""
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.generate import generate

    ref = build(name, dtype, tmp_path / name)
    want, want_logits = hf_greedy(ref, PROMPT, N_TOKENS)
    assert len(set(want)) > 3 and margins_ok(want_logits)
    cfg, weights = load_model(tmp_path / name)
    assert cfg.arch == ref.config.architectures[0] and cfg.moe is not None
    fused = fused_step(weights)

    for how in ("reference", "fused"):
        got = generate(cfg, weights, PROMPT, N_TOKENS, chunk=8, step_fn=fused if how == "fused" else None)
        rel = scaled_error(got.logits, want_logits)
        print(f"\nHF parity {name} {dtype} {how}: max |diff| / max |logits| = {rel:.2e}")
        assert got.generated_ids == want, how
        assert rel < TOL, how


@pytest.mark.hf
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_the_fused_spelling_of_transformers_5(name, tmp_path):
    """A checkpoint holding each layer's experts as the fused 3-D tensors reads as the per-expert one."""
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.generate import generate

    ref = build(name, "float32", tmp_path / name)
    want, want_logits = hf_greedy(ref, PROMPT[:6], 6)
    fuse_experts(tmp_path / name, name)
    cfg, weights = load_model(tmp_path / name)
    got = generate(cfg, weights, PROMPT[:6], 6, chunk=4)
    assert got.generated_ids == want
    assert scaled_error(got.logits, want_logits) < TOL


@pytest.mark.hf
def test_missing_experts_and_bad_config_are_one_line(tmp_path):
    from lanefuse.engine.front.load import load_model
    from safetensors.numpy import load_file, save_file

    build("qwen3_moe", "float32", tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    t = load_file(str(f))
    del t["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"no tensor `model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight` \(nor the "
                                        r"fused `model\.layers\.2\.mlp\.experts\.gate_up_proj`\)"):
        load_model(tmp_path / "m")
    c = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**c, "num_experts_per_tok": 9}))
    with pytest.raises(UserError, match=r"`num_experts_per_tok` 9 is more than the 8 experts"):
        load_model(tmp_path / "m")


# -- the fused plan in the numpy arena, its classes alone and held (no transformers needed) -------------------------

def tiny(arch: str, layers: int = 2, **moe) -> "object":
    from lanefuse.engine.front.model import ModelConfig
    from lanefuse.engine.front.families.mixtures import MoeConfig

    m = dict(experts=8, k=2, inter=37, norm_topk=arch != "Qwen2MoeForCausalLM", sparse=tuple(range(layers)))
    m.update(moe)
    return ModelConfig(arch, 32, layers, 4, 2, 8, 40, 64, qk_norm=arch == "Qwen3MoeForCausalLM",
                       qkv_bias=arch == "Qwen2MoeForCausalLM", max_len=32, moe=MoeConfig(**m))


def weights_for(cfg, fmt="f32", seed=0):
    from lanefuse.engine.front.stepweights import random_weights
    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.front.weights import Weights

    w = random_weights(build_step(cfg, 1), seed)
    if fmt == "f32":
        return Weights(w.store, cfg)
    arrays = {n: (encode(a, fmt), fmt) if a.ndim == 2 else a for n, (a, _) in w.store.arrays.items()}
    return Weights.from_dict(arrays, cfg)


def plan_against_reference(cfg, weights, rows, **opts):
    """The plan of a step of `rows` run in its arena (exact twins) and the reference interpreter, from the same
    caches: the logits and every cache table agree."""
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.generate import new_caches
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    g = build_step(cfg, rows)
    s = plan(g, **opts)
    g0 = np.random.default_rng(rows)
    caches = {k: r32(g0, *v.shape) for k, v in new_caches(cfg).items()}
    inputs = {"token": g0.integers(0, cfg.vocab, rows).astype(np.int32), "pos": np.array([3], np.int32)}
    ref = evaluate(g, weights, {**inputs, **{k: v.copy() for k, v in caches.items()}})
    mine = {k: v.copy() for k, v in caches.items()}
    got = NumpyRunner(s, weights).step({**inputs, **mine})
    scale = float(np.abs(ref["logits"]).max())
    assert float(np.abs(got["logits"] - ref["logits"]).max()) <= TOL * scale
    for k in mine:
        np.testing.assert_allclose(mine[k], ref[k], rtol=1e-5, atol=1e-5)
    return s


def layer_kinds(s, layer):
    return [k.census for l in s.launches if l.layer == layer for k in l.launch.kernels()]


def test_census_golden_of_a_qwen3_moe_decode_layer():
    """Five launches a layer: q/k/v with heads normed, rotated and cached (a fold); the attention; the o product with
    the residual add and the next norm (a fold); the mixture, two kernels, its weighed sum added to the residual and
    normed for the next layer by the last block of the row (moe_deferred_finalize)."""
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    s = plan(build_step(tiny("Qwen3MoeForCausalLM", layers=4), 1))
    assert layer_kinds(s, 1) == layer_kinds(s, 2) == ["moe", "moe", "fold", "attention", "fold"]
    assert s.census == {"attention": 4, "fold": 10, "moe": 8}
    assert s.fusions.get("moe_deferred_finalize") == 4  # the last layer's with the final norm
    # layer N's table lists the launches filed under it: a mixture finalized with the next layer's norm is filed
    # under that layer, the last one's (with the final norm) under its own; -1: the head product and the arg-max
    assert s.per_layer() == {0: 4, 1: 5, 2: 5, 3: 7, -1: 1}  # the head with its arg-max


FAMILIES = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"]
RULES = ["shared_expert_fusion", "moe_token_sort", "moe_token_sort.shared", "moe_deferred_finalize",
         "moe_deferred_finalize.shared"]


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 6])
def test_plan_against_the_reference(arch, fmt, rows):
    cfg = tiny(arch, shared_inter=20 if arch == "Qwen2MoeForCausalLM" else 0)
    plan_against_reference(cfg, weights_for(cfg, fmt), rows)


@pytest.mark.parametrize("held", RULES + [" ".join(RULES)])
@pytest.mark.parametrize("rows", [1, 6])
def test_each_mixture_rule_held(held, rows):
    """Holding a mixture rule (or all of them) keeps the numbers; the held rule fires nowhere."""
    cfg = tiny("Qwen2MoeForCausalLM", shared_inter=20)
    s = plan_against_reference(cfg, weights_for(cfg, "bf16", 1), rows, held=tuple(held.split()))
    assert not set(held.split()) & set(s.fusions)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_a_chunk_sorted_by_expert(arch):
    """A prefill chunk where bytes dominate (launches nearly free, experts wide): the plan sorts its rows by expert
    (moe_token_sort, four kernels a mixture) and equals the reference."""
    from lanefuse.lane.lower.knobs import Knobs

    cfg = tiny(arch, inter=96, shared_inter=20 if arch == "Qwen2MoeForCausalLM" else 0)
    s = plan_against_reference(cfg, weights_for(cfg, "f32", 2), 12, knobs=Knobs(launch_us=0.01, fixed_scale=0.001))
    rule = "moe_token_sort.shared" if arch == "Qwen2MoeForCausalLM" else "moe_token_sort"
    assert s.fusions.get(rule), s.fusions
    assert any(getattr(l.launch, "sort", False) for l in s.launches)


def test_the_plan_is_one_op_whatever_the_expert_count():
    """The e-graph and the plan do not grow with the experts: 8 or 128 experts, the same launches."""
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    a = plan(build_step(tiny("Qwen3MoeForCausalLM", experts=8), 1))
    b = plan(build_step(tiny("Qwen3MoeForCausalLM", experts=128, k=8), 1))
    assert [l.launch.census for l in a.launches] == [l.launch.census for l in b.launches]
    assert len(build_step(tiny("Qwen3MoeForCausalLM", experts=128, k=8), 1).ops) == \
        len(build_step(tiny("Qwen3MoeForCausalLM", experts=8), 1).ops)


@pytest.mark.parametrize("arch", FAMILIES)
def test_saved_plans_load_pass_the_checks_and_run_alike(arch, tmp_path):
    """Decode, a chunk, a sorted chunk: saved, loaded (every plan check), equal launches and the same logits."""
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.lower.planfile import load, save
    from lanefuse.lane.run.generate import new_caches
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg = tiny(arch, inter=96, shared_inter=20 if arch == "Qwen2MoeForCausalLM" else 0)
    w = weights_for(cfg, "bf16", 3)
    for rows, kw in ((1, {}), (6, {}), (12, {"knobs": Knobs(launch_us=0.01, fixed_scale=0.001)})):
        p = plan(build_step(cfg, rows), **kw)
        save(p, str(tmp_path / "p.json"))
        q = load(str(tmp_path / "p.json"))
        assert [x.launch for x in q.launches] == [x.launch for x in p.launches]
        outs = []
        for s in (p, q):
            env = {**new_caches(cfg), "token": np.arange(rows, dtype=np.int32) + 5, "pos": np.array([0], np.int32)}
            outs.append(NumpyRunner(s, w).step(env)["logits"])
        assert np.array_equal(outs[0], outs[1])
    assert any(x.launch.census == "moe" and x.launch.sort for x in p.launches)


def test_config_refusals_are_one_line():
    from lanefuse.engine.front.hfconfig import config_from_hf

    base = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 37,
            "vocab_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 37}
    cfg = config_from_hf(base)
    assert cfg.moe.experts == 8 and cfg.moe.sparse == (0, 1) and not cfg.moe.norm_topk and cfg.qk_norm
    assert config_from_hf({**base, "num_local_experts": 16, "num_experts": None}).moe.experts == 16  # as 5.x writes
    assert config_from_hf({**base, "mlp_only_layers": [0], "norm_topk_prob": True}).moe.sparse == (1,)
    assert config_from_hf({**base, "num_hidden_layers": 4, "decoder_sparse_step": 2}).moe.sparse == (1, 3)
    bad = [({"mlp_only_layers": "0"}, r"`mlp_only_layers` is 0; expected a list of layer numbers"),
           ({"num_experts_per_tok": 0}, r"`num_experts_per_tok` is 0; expected a positive integer"),
           ({"moe_intermediate_size": None}, r"missing `moe_intermediate_size`"),
           ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "sliding_window": 0},
            r"`sliding_window` is 0; expected a positive integer"),
           ({"architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 16, "qkv_bias": False},
            r"a Qwen2-MoE without its q/k/v biases"),
           ({"architectures": ["Qwen2MoeForCausalLM"]}, r"missing `shared_expert_intermediate_size`")]
    for change, msg in bad:
        with pytest.raises(UserError, match=r"^config\.json: " + msg):
            config_from_hf({**base, **change})


def test_experts_of_two_formats_or_the_wrong_shape_are_refused_in_words():
    from lanefuse.engine.front.families.mixtures import ExpertStore
    from lanefuse.engine.front.weights import DictStore

    cfg = tiny("Qwen3MoeForCausalLM", layers=1)
    arrays = {f"model.layers.0.mlp.experts.{e}.{r}.weight": np.zeros((37, 32) if r != "down_proj" else (32, 37),
                                                                      np.float32)
              for e in range(8) for r in ("gate_proj", "up_proj", "down_proj")}
    arrays["model.layers.0.mlp.gate.weight"] = np.zeros((8, 32), np.float32)
    store = ExpertStore(DictStore(arrays), cfg, "m")
    assert store.info("model.layers.0.mlp.experts.gate_up_proj") == ((8 * 74, 32), "f32")
    assert store.raw("model.layers.0.mlp.experts.down_proj")[0].shape == (8 * 32, 37)
    arrays["model.layers.0.mlp.experts.3.up_proj.weight"] = np.zeros((37, 32), np.float16)
    with pytest.raises(UserError, match=r"experts of `model\.layers\.0\.mlp\.experts\.gate_up_proj` are stored in "
                                        r"several formats \(f16, f32\)"):
        ExpertStore(DictStore(arrays), cfg, "m").info("model.layers.0.mlp.experts.gate_up_proj")
    arrays["model.layers.0.mlp.experts.3.up_proj.weight"] = np.zeros((36, 32), np.float32)
    with pytest.raises(UserError, match=r"has shape"):
        ExpertStore(DictStore(arrays), cfg, "m").info("model.layers.0.mlp.experts.gate_up_proj")


def test_route_properties():
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings, strategies as st
    from hypothesis.extra.numpy import arrays

    @settings(max_examples=200, deadline=None)
    @given(st.integers(1, 12).flatmap(lambda e: st.tuples(
        arrays(np.float64, (3, e), elements=st.sampled_from([-2.0, -0.5, 0.0, 0.5, 1.0, 3.0])),
        st.integers(1, e), st.booleans())))
    def check(case):
        logits, k, norm = case
        chosen, w = route(logits, k, norm)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        for r in range(logits.shape[0]):
            c = chosen[r].tolist()
            assert len(set(c)) == k
            # falling probability, equal ones by the lower expert, and no expert left out beats the last chosen
            assert all((p[r, a], -a) > (p[r, b], -b) for a, b in zip(c, c[1:]))
            rest = [e for e in range(logits.shape[1]) if e not in c]
            assert all((p[r, c[-1]], -c[-1]) > (p[r, e], -e) for e in rest)
            np.testing.assert_allclose(w[r].sum() if norm else w[r], 1.0 if norm else p[r, c])

    check()


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_fast_runner_against_the_exact_twins(arch):
    """`lanefuse run` on the CPU (the fast twins: f32 BLAS, each expert's rows gathered) against the exact twins:
    the same greedy tokens, logits within 1e-4 of their scale, over 4-row chunks and decode."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cpu_fast import _fast_against_exact

    cfg = tiny(arch, shared_inter=20 if arch == "Qwen2MoeForCausalLM" else 0)
    _fast_against_exact(cfg, weights_for(cfg, "bf16", 4), [3, 1, 4, 1, 5, 9, 2, 6, 5], 10)


def test_a_mixture_step_round_trips_through_its_text():
    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.stepyaml import from_yaml, to_yaml

    for arch in FAMILIES:
        g = build_step(tiny(arch, shared_inter=20 if arch == "Qwen2MoeForCausalLM" else 0), 3)
        assert from_yaml(to_yaml(g)) == g


@pytest.mark.parametrize("rows", [1, 6])
def test_the_conservative_lane_runs_the_mixture_classes_as_their_parts(rows):
    cfg = tiny("Qwen2MoeForCausalLM", shared_inter=20)
    s = plan_against_reference(cfg, weights_for(cfg, "f32", 6), rows, lane="conservative")
    assert all(l.cls not in ("shared_expert_fusion", "moe_token_sort", "moe_deferred_finalize") for l in s.launches)
    assert all(not (l.launch.census == "moe" and (l.launch.shared or l.launch.sort or l.launch.add))
               for l in s.launches)
