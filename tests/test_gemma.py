"""Gemma 2 and Gemma 3 (text) against transformers: tiny random models saved with `save_pretrained` (norm weights far
from 0 so the norm's 1 + w matters, soft caps small enough to bite, a window shorter than prompt + generated, awkward
sizes), f32 and bf16, loaded by the front and run by the reference interpreter and by the fused plan in the numpy
arena: the same greedy tokens, logits within 1e-4 of their scale; decode steps and prefill chunks crossing the
window. Also the config readings (4.x and 5.x layouts, the text model of a Gemma3ForConditionalGeneration in either
checkpoint layout), the refusals, and the census of a decode layer."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from hf_ref import fused_step, hf_greedy, margins_ok, scaled_error
from lanefuse.engine.errors import UserError
from lanefuse.engine.front.hfconfig import config_from_hf

TOL = 1e-4
PROMPT = [3, 17, 5, 42, 8, 11, 29]  # 7 rows: with chunk=4 a chunk of 4 and one of 3, both past the window of 5
N_TOKENS = 12

CASES = {
    # name: (family, config kwargs, saved dtype, gain of the products' weights: one under which greedy decoding of
    # the tied-embedding model wanders instead of repeating a token)
    "gemma2_f32": ("Gemma2", dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=37, vocab_size=97, sliding_window=5,
                                  query_pre_attn_scalar=20, attn_logit_softcapping=1.5,
                                  final_logit_softcapping=3.0), "float32", 1.0),
    "gemma2_bf16_erf": ("Gemma2", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=24, intermediate_size=41, vocab_size=89,
                                       sliding_window=4, hidden_activation="gelu", attn_logit_softcapping=2.0,
                                       final_logit_softcapping=4.0, query_pre_attn_scalar=24,
                                       tie_word_embeddings=False), "bfloat16", 1.0),
    "gemma3_f32": ("Gemma3", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                                  head_dim=24, intermediate_size=37, vocab_size=113, sliding_window=5,
                                  query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                               "full_attention"],
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 50000.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 100.0}}), "float32", 1.0),
    "gemma3_bf16": ("Gemma3", dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                                   head_dim=16, intermediate_size=29, vocab_size=101, sliding_window=4,
                                   query_pre_attn_scalar=16, attn_logit_softcapping=None, sliding_window_pattern=3,
                                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 500.0}}), "bfloat16", 2.0),
}


# -- config.json readings (no torch needed) -------------------------------------------------------------------------

def _g2(**kw):
    c = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 37, "vocab_size": 97}
    c.update(kw)
    return c


def test_gemma2_defaults_as_transformers_takes_them():
    cfg = config_from_hf(_g2())
    assert cfg.act == "gelu" and cfg.attn_softcap == 50.0 and cfg.final_softcap == 30.0
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2  # even layers slide
    assert cfg.window == 4096 and cfg.attn_scale == 256 ** -0.5 and cfg.tie_embeddings
    assert cfg.rope_theta == 10000.0 and cfg.local_rope() is None
    assert config_from_hf(_g2(final_logit_softcapping=None, attn_logit_softcapping=None)).final_softcap == 0.0


def test_gemma3_4x_config_of_a_conditional_generation_checkpoint():
    """As google/gemma-3-4b-it's config.json (4.x): a text_config naming six keys, the rest transformers' defaults;
    rope_scaling on the global layers, rope_local_base_freq on the sliding ones, sliding_window_pattern 6."""
    c = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
         "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                         "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                         "sliding_window": 1024},
         "vision_config": {"hidden_size": 1152}}
    cfg = config_from_hf(c)
    assert (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.vocab) == (8, 4, 256, 262208)
    assert cfg.rope_theta == 1e6 and dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 8.0}
    assert cfg.local_rope_theta == 10000.0 and cfg.local_rope_scaling == ()
    assert cfg.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert cfg.window == 1024 and cfg.qk_norm and cfg.attn_softcap == 0.0 and cfg.final_softcap == 0.0
    assert cfg.prefix == "language_model.model."


def test_gemma3_5x_rope_parameters_by_layer_type():
    c = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 1, "head_dim": 24, "intermediate_size": 37, "vocab_size": 113,
         "layer_types": ["sliding_attention", "full_attention"],
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}
    cfg = config_from_hf(c)
    assert cfg.rope_theta == 5e4 and dict(cfg.rope_scaling)["factor"] == 2.0
    assert cfg.local_rope_theta == 100.0 and cfg.local_rope().rope_theta == 100.0


@pytest.mark.parametrize("kw,msg", [
    ({"hidden_activation": "relu"}, "hidden_activation `relu` is not supported"),
    ({"attention_bias": True}, "attention_bias is not supported for Gemma"),
    ({"layer_types": ["sliding_attention"] * 3}, "`layer_types` is .*expected a list of 4 layer types"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, r"`layer_types\[1\]` is 'chunked_attention'"),
    ({"final_logit_softcapping": -1.0}, "`final_logit_softcapping` is -1.0; expected a positive number"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope type `yarn` is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"num_key_value_heads": 3}, "`num_key_value_heads` 3 does not divide `num_attention_heads` 4"),
])
def test_gemma_refusals_name_the_key(kw, msg):
    with pytest.raises(UserError, match=msg):
        config_from_hf(_g2(**kw), "config.json")


def test_both_gelus_named():
    from lanefuse.engine.interp import OP_IMPL

    x = np.linspace(-4, 4, 17).astype(np.float32)
    tanh, erf = OP_IMPL["gelu"](x), OP_IMPL["gelu_erf"](x)
    import math

    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    assert np.abs(erf - want).max() < 1e-6
    assert np.abs(tanh - want).max() > 1e-4  # two different functions
    assert config_from_hf(_g2(hidden_activation="gelu")).act == "gelu_erf"
    assert config_from_hf(_g2(hidden_activation=None, hidden_act="gelu_pytorch_tanh")).act == "gelu"


# -- transformers-made models --------------------------------------------------------------------------------------

def _torch():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return torch, transformers


def _init(model, torch, seed: int, gain: float):
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(0.5 + 0.3 * torch.randn_like(p))  # 1 + w near 1.5: a bug that drops the 1 shows
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p) * 0.05)  # scaled by sqrt(hidden) on the way in; tied: kept small
            elif p.ndim == 2:
                p.copy_(gain * torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.1 * torch.randn_like(p))


def _build(name: str, tmp_path, conditional: bool = False):
    torch, transformers = _torch()
    family, kw, dtype, gain = CASES[name]
    kw = dict(kw)
    cfg_cls = transformers.Gemma2Config if family == "Gemma2" else transformers.Gemma3TextConfig
    cfg = cfg_cls(max_position_embeddings=64, **kw)
    if conditional:
        vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=32, patch_size=16)
        full = transformers.Gemma3Config(text_config=cfg.to_dict(), vision_config=vision.to_dict(),
                                         mm_tokens_per_image=4)
        model = transformers.Gemma3ForConditionalGeneration(full).eval()
    else:
        cls = transformers.Gemma2ForCausalLM if family == "Gemma2" else transformers.Gemma3ForCausalLM
        model = cls(cfg).eval()
    _init(model, torch, zlib.crc32(name.encode()), gain)
    folder = tmp_path / (name + ("_cond" if conditional else ""))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    ref = type(model).from_pretrained(folder, dtype=torch.float32).eval()
    return folder, ref


def _compare(folder, ref, fused: bool, chunk: int = 4):
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.generate import generate

    want_tokens, want_logits = hf_greedy(ref, PROMPT, N_TOKENS)
    assert len(set(want_tokens)) > 3 and margins_ok(want_logits, relative=False)  # the check means something
    cfg, weights = load_model(folder)
    step = fused_step(weights) if fused else None
    got = generate(cfg, weights, PROMPT, N_TOKENS, step_fn=step, chunk=chunk)
    rel = scaled_error(got.logits, want_logits)
    print(f"\n{folder.name} ({'fused plan' if fused else 'reference'}): max |diff| / max |logits| = {rel:.2e}")
    assert got.generated_ids == want_tokens
    assert rel < TOL
    return cfg


@pytest.mark.hf
@pytest.mark.parametrize("name", list(CASES))
def test_gemma_reference_matches_transformers(name, tmp_path):
    folder, ref = _build(name, tmp_path)
    cfg = _compare(folder, ref, fused=False)
    assert cfg.arch == ref.config.architectures[0]


@pytest.mark.hf
@pytest.mark.parametrize("name", list(CASES))
def test_gemma_fused_plan_matches_transformers(name, tmp_path):
    folder, ref = _build(name, tmp_path)
    _compare(folder, ref, fused=True)


# -- the launches Gemma adds: each kind's exact twin against the reference interpreter, its fast twin against it ------

def _both(launch, arrays, weights=None):
    """(exact env, fast env): both numpy twins of `launch` on copies of the same arrays."""
    from lanefuse.kernels import HostEnv

    out = []
    for how in ("numpy", "fast"):
        env = HostEnv({k: v.copy() for k, v in arrays.items()}, dict(weights or {}))
        getattr(launch, how)(env)
        out.append(env)
    return out


def _close(got, want, tol=2e-5):
    scale = max(float(np.abs(want).max()), 1.0)
    assert float(np.abs(np.asarray(got, np.float64) - want).max()) <= tol * scale


@pytest.mark.parametrize("window,splits,rows,pos", [(0, 1, 1, 9), (5, 2, 1, 13), (4, 3, 3, 9), (0, 2, 4, 0)])
def test_attention_soft_cap_twins_equal_the_reference(window, splits, rows, pos):
    from lanefuse.engine.interp import OP_IMPL
    from lanefuse.kernels import Attention

    g = np.random.default_rng(window * 7 + splits)
    heads, kv, hd, L, cap, scale = 4, 2, 16, 20, 1.5, 0.6
    q, kc, vc = (3 * g.standard_normal(s).astype(np.float32) for s in ((rows, heads * hd), (L, kv * hd), (L, kv * hd)))
    p = np.array([pos], np.int32)
    want = OP_IMPL["attention"](q, kc, vc, p, heads=heads, kv_heads=kv, hd=hd, vd=hd, scale=scale, window=window,
                                softcap=cap)
    uncapped = OP_IMPL["attention"](q, kc, vc, p, heads=heads, kv_heads=kv, hd=hd, vd=hd, scale=scale,
                                    window=window)
    assert np.abs(want - uncapped).max() > 1e-2  # the cap bites
    a = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, hd, L, rows, scale, window=window,
                  splits=splits, softcap=cap)
    assert a.check() is None
    arrays = {"q": q.reshape(-1), "kc": kc.reshape(-1), "vc": vc.reshape(-1), "pos": p,
              "o": np.zeros(rows * heads * hd, np.float32)}
    for env in _both(a, arrays):
        _close(env.array("o").reshape(rows, -1), want)
    assert "soft cap of -1.0" in Attention("q", "k", "v", "pos", "o", 4, 2, 8, 8, 8, 1, 1.0, softcap=-1.0).check().reason


@pytest.mark.parametrize("split,m", [(1, 1), (2, 1), (1, 3)])
def test_gemv_soft_cap_in_the_epilogue(split, m):
    from lanefuse.engine.interp import OP_IMPL
    from lanefuse.kernels import Dst, Gemv, Softcap
    from lanefuse.kernels.common import decode, encode

    g = np.random.default_rng(split + m)
    k, n, cap = 64, 37, 3.0
    x = g.standard_normal((m, k)).astype(np.float32)
    w = encode(g.standard_normal((n, k)).astype(np.float32), "bf16")
    want = OP_IMPL["softcap"](OP_IMPL["matmul"](x, decode(w, "bf16")), cap=cap)
    launch = Gemv("x", "w", "bf16", Dst("y"), k, n, m, split=split, cap=cap)
    assert launch.check() is None
    for env in _both(launch, {"x": x.reshape(-1), "y": np.zeros(m * n, np.float32)}, {"w": (w, "bf16")}):
        _close(env.array("y").reshape(m, n), want)
    alone = Softcap("x", "y", m * k, cap)
    for env in _both(alone, {"x": x.reshape(-1), "y": np.zeros(m * k, np.float32)}):
        _close(env.array("y"), OP_IMPL["softcap"](x, cap=cap).reshape(-1))
    assert Softcap("x", "y", 4, 0.0).check() is not None


@pytest.mark.parametrize("rows", [1, 3])
def test_sandwich_norm_twins_equal_the_reference(rows):
    """norm_then_add's launch: y = rmsnorm(x + rmsnorm(b) · pw) · w, the sum written too."""
    from lanefuse.engine.interp import OP_IMPL
    from lanefuse.kernels import Norm, PreNorm

    g = np.random.default_rng(rows)
    c = 40
    x, b = g.standard_normal((rows, c)).astype(np.float32), 5 * g.standard_normal((rows, c)).astype(np.float32)
    pw, w = (1.5 + 0.3 * g.standard_normal(c)).astype(np.float32), (1.5 + 0.3 * g.standard_normal(c)).astype(np.float32)
    s = OP_IMPL["add"](x, OP_IMPL["rmsnorm"](b, pw, eps=1e-6))
    want = OP_IMPL["rmsnorm"](s, w, eps=1e-5)
    launch = Norm("x", "w", "y", rows, c, 1e-5, add="b", sum="s", pre=PreNorm("pw", 1e-6))
    arrays = {"x": x.reshape(-1), "b": b.reshape(-1), "y": np.zeros(rows * c, np.float32),
              "s": np.zeros(rows * c, np.float32)}
    for env in _both(launch, arrays, {"w": (w, "f32"), "pw": (pw, "f32")}):
        _close(env.array("y").reshape(rows, c), want)
        _close(env.array("s").reshape(rows, c), s)


# -- census goldens and held rules (shapes only: no transformers) ---------------------------------------------------

def gemma_shape(family: str, layers: int = 4, **kw):
    """A small Gemma 2 / Gemma 3 shape (sliding and global layers alternating; Gemma 2 soft-capped)."""
    from lanefuse.engine.front.families.gemma import GemmaConfig

    base = dict(hidden=64, layers=layers, heads=4, kv_heads=2, head_dim=16, inter=96, vocab=128, max_len=32, window=6,
                attn_scale=0.25, tie_embeddings=True,
                layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)))
    if family == "gemma2":
        base.update(attn_softcap=50.0, final_softcap=30.0)
    else:
        base.update(qk_norm=True, local_rope_theta=10000.0, rope_theta=1e6)
    base.update(kw)
    return GemmaConfig("Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM", **base)


# the decode step's census: 5 launches a layer (qkv products with their heads normed and rotated and k/v written into
# the cache rows; the soft-capped attention; the o product with the sandwich norm, the residual add and the next norm;
# gate/up with the GELU; the down product with the sandwich and the next layer's norm), and the step's ends: the
# embedding gathered, scaled and normed in one fold, the lm_head product with the final cap in its epilogue, the arg-max
# (Gemma 2); Gemma 3's head uncapped, so the head and the arg-max one fold (head_argmax)
DECODE_CENSUS = {"gemma2": {"fold": 3 * 4 + 1, "attention": 4, "gemv_glu": 4, "gemv": 1, "argmax": 1},
                 "gemma3": {"fold": 3 * 4 + 2, "attention": 4, "gemv_glu": 4}}


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_decode_census_golden(family):
    from lanefuse.lane.lower.plan import plan

    cfg = gemma_shape(family)
    s = plan(cfg.build_step(1))
    assert s.census == DECODE_CENSUS[family], s.census
    assert s.n_launches == 5 * cfg.layers + (3 if family == "gemma2" else 2)
    body = [v for k, v in s.per_layer().items() if 0 <= k < cfg.layers - 1]
    assert max(body) <= 5
    assert s.fusions.get("gemv_norm_epilogue.sandwich") == 2 * cfg.layers  # after the o and the down products
    assert s.fusions.get("embed_norm.scaled") == 1
    heads = [x.launch for x in s.launches if x.launch.census == "gemv"] or [
        x.launch.first for x in s.launches if x.launch.census == "fold" and x.launch.form()[0] == "gemv_argmax"]
    assert (heads[0].cap == 30.0) == (family == "gemma2")  # the final cap in the lm_head's epilogue
    att = [x.launch for x in s.launches if x.launch.census == "attention"]
    assert [a.window for a in att] == [6, 0, 6, 0]  # the window on the sliding layers
    assert all(a.softcap == (50.0 if family == "gemma2" else 0.0) for a in att)




@pytest.mark.parametrize("held", [frozenset(), frozenset({"gemv_norm_epilogue.sandwich"}),
                                  frozenset({"norm_then_add", "gemv_norm_epilogue.sandwich"}),
                                  frozenset({"gemv_softcap", "embed_norm.scaled", "embed_scale"})])
@pytest.mark.parametrize("family,rows", [("gemma2", 1), ("gemma2", 5), ("gemma3", 3)])
def test_fused_plan_equals_the_reference_with_rules_held(family, rows, held):
    """The plan with Gemma's fusions held back (each then runs as its parts: a norm with no pre, a softcap launch,
    a gather and a scale) still computes what the lifted graph does, at a position past the window."""
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.front.stepweights import random_weights
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg = gemma_shape(family, layers=2, max_len=24)
    g = cfg.build_step(rows)
    w = random_weights(g, 1)
    rng = np.random.default_rng(rows)
    env = {"token": rng.integers(0, 100, rows).astype(np.int32), "pos": np.array([9], np.int32)}
    for t in g.io.tables:
        env[t] = rng.standard_normal(g.tensors[t].shape).astype(np.float32)
    want = evaluate(g, w, {k: v.copy() for k, v in env.items()})
    s = plan(g, held=held)
    if held == {"gemv_norm_epilogue.sandwich"}:  # the sandwich then runs as its own Norm launch with `pre`
        assert s.fusions.get("norm_then_add", 0) >= 2 * cfg.layers - 1
        assert any(x.launch.census == "norm" and x.launch.pre is not None for x in s.launches)
    for exact in (True, False):
        got = NumpyRunner(s, w, exact=exact).step({k: v.copy() for k, v in env.items()})
        _close(got["logits"], want["logits"], 1e-4)
        assert int(np.asarray(got["next"]).reshape(-1)[0]) == int(np.asarray(want["next"]).reshape(-1)[0])


# -- checkpoints: a Gemma3ForConditionalGeneration's text model (both layouts), the command's --json logits -----------

@pytest.mark.hf
@pytest.mark.parametrize("layout", ["hub", "4.52"])
def test_conditional_generation_text_model(layout, tmp_path):
    """transformers 5.24's save_pretrained of a Gemma3ForConditionalGeneration writes the hub's layout, as 4.50-4.51
    did: language_model.model.*, vision_tower.*, multi_modal_projector.*; 4.52-4.57 wrote model.language_model.*,
    model.vision_tower.*, model.multi_modal_projector.*. The front loads the text model of either, the tower left
    out."""
    folder, ref = _build("gemma3_bf16", tmp_path, conditional=True)  # skips without torch and transformers
    from safetensors.torch import load_file, save_file  # bf16 tensors: numpy has no bfloat16

    cfg_json = json.loads((folder / "config.json").read_text())
    assert cfg_json["architectures"] == ["Gemma3ForConditionalGeneration"] and "text_config" in cfg_json
    files = sorted(folder.glob("*.safetensors"))
    names = {n for f in files for n in load_file(str(f))}
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("language_model.model.layers.0.") for n in names)
    if layout == "4.52":
        for f in files:
            moved = {("model.language_model." + n[len("language_model.model."):] if n.startswith("language_model.model.")
                      else "model." + n): v for n, v in load_file(str(f)).items()}
            save_file(moved, str(f), metadata={"format": "pt"})
    cfg = _compare(folder, ref, fused=True)
    assert cfg.prefix == ("language_model.model." if layout == "hub" else "model.language_model.")


@pytest.mark.hf
def test_run_json_logits_are_capped_like_transformers(tmp_path):
    """`lanefuse run --json` writes the soft-capped logits transformers gives (the arg-max alone would not show a
    missing cap: it is monotone)."""
    import subprocess
    import sys

    folder, ref = _build("gemma2_f32", tmp_path)
    want_tokens, want_logits = hf_greedy(ref, PROMPT, 4)
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", "run", str(folder), "--prompt-ids",
                        ",".join(map(str, PROMPT)), "--tokens", "4", "--json", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["generated_ids"] == want_tokens
    logits = np.asarray(got["logits"], dtype=np.float64)
    want = np.asarray(want_logits)
    assert logits.shape == want.shape and np.abs(logits).max() <= 3.0  # final_logit_softcapping 3.0
    assert float(np.abs(logits - want).max() / np.abs(want).max()) < TOL


def test_the_split_schedule_counts_only_the_window():
    """A sliding layer's attention over a long cache splits (and costs) only its window's positions."""
    from lanefuse.kernels import Attention
    from lanefuse.lane.lower.knobs import Knobs

    full = Attention("q", "kc", "vc", "pos", "o", 8, 4, 128, 128, 4096, 1, 0.1, softcap=50.0)
    slid = Attention("q", "kc", "vc", "pos", "o", 8, 4, 128, 128, 4096, 1, 0.1, window=512, softcap=50.0)
    k = Knobs()
    # two blocks a split want 132 splits to fill the chip twice over: 4096 // 64 against 512 // 64 positions a split
    assert full.tune(k).splits == 64 and slid.tune(k).splits == 8
    assert slid.bytes() < full.bytes() / 4 and slid.flops() * 8 == full.flops()


# -- GGUF files of both (llama.cpp's gemma2, gemma3) ------------------------------------------------------------------

GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
              "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _write_gemma_gguf(model, path):
    """`model` as llama.cpp's convert_hf_to_gguf.py writes a Gemma2Model / Gemma3Model: its metadata keys (the caps
    and the window; gemma3's rope base and linear scaling), its tensor names, every norm weight stored as 1 + w (the
    converter adds the 1), 1-D tensors in f32, the tied head left out."""
    import gguf

    cfg = model.config
    arch = "gemma2" if type(model).__name__.startswith("Gemma2") else "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    w.add_file_type(0)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(float(full["rope_theta"]))
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(full["factor"]))
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        a = t.detach().float().numpy()
        if name.endswith("norm.weight"):
            a = a + 1.0
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        else:
            i, rest = name[len("model.layers."):].split(".", 1)
            g = f"blk.{i}.{GGUF_LAYER[rest.rsplit('.', 1)[0]]}.weight"
        w.add_tensor(g, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.hf
@pytest.mark.parametrize("name", ["gemma2_f32", "gemma3_f32"])
def test_gguf_gemma_matches_transformers(name, tmp_path):
    """A GGUF file of the model (f32, as llama.cpp's converter writes it) through the fused plan: transformers'
    tokens and logits; the gemma3 case's pattern is llama.cpp's (every 6th layer global), so its transformers model
    is given the same layer types."""
    pytest.importorskip("gguf")
    torch, transformers = _torch()
    family, kw, dtype, gain = CASES[name]
    kw = dict(kw)
    if family == "Gemma3":
        kw["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention"
                             for i in range(kw["num_hidden_layers"])]
    cfg_cls = transformers.Gemma2Config if family == "Gemma2" else transformers.Gemma3TextConfig
    model = (transformers.Gemma2ForCausalLM if family == "Gemma2" else transformers.Gemma3ForCausalLM)(
        cfg_cls(max_position_embeddings=64, **kw)).eval()
    _init(model, torch, zlib.crc32(name.encode()), gain)
    path = _write_gemma_gguf(model, tmp_path / f"{name}.gguf")
    from lanefuse.engine.front.load import load_model

    cfg, _ = load_model(path)
    assert cfg.norm_offset == 0.0 and cfg.arch == type(model).__name__
    if family == "Gemma3":  # llama.cpp's local base, which the file does not hold: give transformers the same
        model.config.rope_parameters["sliding_attention"]["rope_theta"] = 10000.0
        model = type(model)(model.config).eval()
        _init(model, torch, zlib.crc32(name.encode()), gain)
        path = _write_gemma_gguf(model, tmp_path / f"{name}.gguf")
    # llama.cpp's attention scale: 1/sqrt(head_dim) for these sizes; give transformers the same
    model.config.query_pre_attn_scalar = model.config.head_dim
    for layer in model.model.layers:
        layer.self_attn.scaling = model.config.head_dim ** -0.5
    _compare(path, model, fused=True)
