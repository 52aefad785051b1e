"""Every family the front reads, and the GGUF block formats, as tiny models for the GPU model tests
(tests/test_gpu_model.py): made and planned on a CPU machine with the engine (bench/gpu_prepare.py calls `prepare`
with PLANDIR/families), run on the GPU machine, which has no solver, no gguf package and no network, from what
`prepare` saved:

    fam-NAME-decode.json, fam-NAME-prefill8.json   the model's decode step and an 8-row prefill chunk, planned
    fam-NAME.npz                                   the constants those plans read, as the front served them (each
                                                   checkpoint-rows constant as stored: f32/f16/bf16/a block format;
                                                   each values constant f32), so the device needs neither the
                                                   checkpoint nor the front; a few MB at most
    gguf-FMT-NUMERICS-decode.json, ...-prefill8.json, gguf-FMT.npz    a GGUF file of FMT rows, planned under
                                                   `--numerics` NUMERICS (f32, q8)
    fam-NAME-b8.json                               the batch family's decode step of 8 sequences (slots)
    families.json                                  what was made: each model's plans, pack and what it covers

Each model is a transformers-made tiny model (seeded random weights at scales that keep greedy tokens apart, awkward
sizes where the kernels allow them). The GPU side (`run_tokens`, `run_chunk`, `run_batch`) runs a saved plan on a
runner made by a factory, so the same code runs the numpy runner, the CuPy runner on a device, and the CuPy runner
over a stand-in `cupy` on the CPU (tests/test_gpu_families_cpu.py).

Nothing here imports torch, transformers, gguf or the planner at module level: the GPU machine imports it for the
loaders and runners alone."""

from __future__ import annotations

import json
import os
import zlib

import numpy as np

SUBDIR = "families"  # bench/gpu_prepare.py's PLANDIR/families holds them
PROMPT = [1, 2, 3, 4]  # fed a row at a time through the decode plan
N_TOKENS = 32
CHUNK = [3, 4, 5, 6, 7, 8, 9, 10]  # the 8-row prefill chunk, from position 0
BATCH_FAMILY = "llama"  # the family whose batch step (8 slots) is saved too
BATCH_SLOTS = 8
BATCH_PROMPTS = [[3, 17, 5, 42, 8, 11], [9, 2], [40, 41, 42, 43, 44], [7], [12, 13, 14], [60, 61],
                 [5, 5, 5, 5], [33], [21, 22, 23, 24, 25, 26, 27], [70, 3], [8, 9, 10], [44]]  # 12 for 8 slots
BATCH_TOKENS = 10

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}

# name -> (transformers class stem, config kwargs, saved dtype, init style, what it covers)
FAMILIES = {
    "llama": ("Llama", dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                            head_dim=16, intermediate_size=136, vocab_size=301, rms_norm_eps=1e-5,
                            rope_parameters=LLAMA3), "bfloat16", "plain", "Llama 3 rope scaling, bf16 rows"),
    "mistral": ("Mistral", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                head_dim=32, intermediate_size=120, vocab_size=257, sliding_window=6), "float32",
                "plain", "a window of 6 (decode past it), f32 rows"),
    "phi3": ("Phi3", dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                          intermediate_size=104, vocab_size=263, sliding_window=5, partial_rotary_factor=0.5,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2), "bfloat16", "plain",
             "fused qkv and gate_up read in parts, half rotary"),
    "qwen2": ("Qwen2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=152, vocab_size=277, rope_theta=1e6), "float16", "plain",
              "q/k/v biases, f16 rows"),
    "qwen3": ("Qwen3", dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                            head_dim=32, intermediate_size=200, vocab_size=311), "bfloat16", "plain",
              "q/k norms, heads wider than hidden/heads"),
    "qwen3_moe": ("Qwen3Moe", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=88, vocab_size=229, num_experts=8,
                                   num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
                                   mlp_only_layers=[1]), "bfloat16", "plain", "8 experts top-2, a dense layer"),
    "mixtral": ("Mixtral", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=72, vocab_size=211, num_local_experts=6, num_experts_per_tok=2,
                                sliding_window=7), "float32", "plain", "6 experts top-2, a window"),
    "qwen2_moe": ("Qwen2Moe", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=233, num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=48, shared_expert_intermediate_size=56,
                                   norm_topk_prob=False), "bfloat16", "plain", "a gated shared expert, unnormed top-k"),
    "gpt_oss": ("GptOss", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, intermediate_size=72, vocab_size=241, num_local_experts=8,
                               num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                               layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5,
                               rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                "original_max_position_embeddings": 32}), "bfloat16", "gptoss",
                "biased router and experts, the clamped GLU, sinks, a window of 8, yarn"),
    "gemma2": ("Gemma2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, intermediate_size=88, vocab_size=223, sliding_window=6,
                              query_pre_attn_scalar=20, attn_logit_softcapping=5.0, final_logit_softcapping=8.0),
               "float32", "gemma", "soft caps, sandwich norms, a window of 6, tied embeddings"),
    "gemma3": ("Gemma3", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=24, intermediate_size=72, vocab_size=239, sliding_window=5,
                              query_pre_attn_scalar=24,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 50000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
               "bfloat16", "gemma", "q/k norms, two rotations, sliding and full layers"),
    "qwen3_next": ("Qwen3Next", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=32, intermediate_size=72, vocab_size=251,
                                     linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                                     linear_num_key_heads=2, linear_num_value_heads=4, num_experts=6,
                                     num_experts_per_tok=2, moe_intermediate_size=40,
                                     shared_expert_intermediate_size=32, decoder_sparse_step=2,
                                     layer_types=["linear_attention", "full_attention", "linear_attention",
                                                  "full_attention"]), "bfloat16", "qwen3next",
                   "the gated delta rule and its convolution carried, gated attention, experts"),
    "olmo2": ("Olmo2", dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                            head_dim=32, intermediate_size=136, vocab_size=281, eos_token_id=2), "bfloat16", "plain",
              "norms after the blocks, q/k normed over the whole projection"),
    "deepseek_v3": ("DeepseekV3", dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=4, intermediate_size=160, moe_intermediate_size=64,
                                       vocab_size=263, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                       topk_group=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=512,
                                       q_lora_rank=96, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32),
                    "bfloat16", "deepseek", "latent attention (512 + 64: the wide kernel), grouped sigmoid routing"),
}

# a family's seed salt: one under which its 32 tokens wander, top two apart by more than 1e-3 of the logits' scale
SALTS: dict[str, int] = {"phi3": 2, "qwen2_moe": 2, "gemma2": 1}

GGUF_FORMATS = ("q8_0", "q4_0", "q4_k", "q6_k")
GGUF_NUMERICS = ("f32", "q8")
# GGUF models: rows of 32-value blocks for q8_0/q4_0 (an awkward vocabulary and FFN), of 256 for the K-quants
GGUF_SHAPES = {
    "q8_0": ("qwen2", dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                           intermediate_size=160, vocab_size=403)),
    "q4_0": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=224, vocab_size=389)),
    "q4_k": ("llama", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=512, vocab_size=400)),
    "q6_k": ("qwen3", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, intermediate_size=512, vocab_size=397)),
}


def model_names() -> list[str]:
    """Every model `prepare` makes: the families, then each GGUF format under each numerics."""
    return [f"fam-{n}" for n in FAMILIES] + [f"gguf-{f}-{q}" for f in GGUF_FORMATS for q in GGUF_NUMERICS]


# -- the CPU side: models made, planned and packed ------------------------------------------------------------------

def _init(model, style: str, seed: int) -> None:
    """Every parameter re-drawn, seeded, at a scale that keeps the residual alive and the routing decisive."""
    import torch

    torch.manual_seed(seed)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if style == "gemma" and "norm" in name:
                p.copy_(0.5 + 0.3 * torch.randn_like(p))  # Gemma's norms scale by 1 + w
            elif style == "qwen3next" and name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # the gated norm scales by w
            elif style == "qwen3next" and "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))  # the zero-centred norms scale by 1 + w
            elif name.endswith("A_log"):  # slow and fast forgetting heads
                p.copy_(torch.empty_like(p).uniform_(0.05, 2.0).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(1.0 + torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p) * ((0.05 if style == "gemma" else 0.1) if tied else 1.0))
            elif p.dim() == 1 or name.endswith("_bias"):
                p.copy_((0.3 if style in ("gptoss", "deepseek") else 0.1) * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "router.weight", "block_sparse_moe.gate.weight")):
                p.copy_(3 * torch.randn_like(p) / p.shape[-1] ** 0.5)
            elif style == "gptoss" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(2 * torch.randn_like(p) / p.shape[-2] ** 0.5)  # stored (E, in, out)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change the choices
                b.copy_(0.5 * torch.randn_like(b))


def build_family(name: str, folder: str, salt: int | None = None) -> dict:
    """Family `name` as a transformers-made checkpoint folder; its config.json's contents."""
    import torch
    import transformers

    stem, kw, dtype, style, _ = FAMILIES[name]
    kw = {"max_position_embeddings": 128, **kw}
    cfg_cls = getattr(transformers, "Gemma3TextConfig" if stem == "Gemma3" else f"{stem}Config")
    model = getattr(transformers, f"{stem}ForCausalLM")(cfg_cls(**kw)).eval()
    _init(model, style, zlib.crc32(name.encode()) + (SALTS.get(name, 0) if salt is None else salt))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def build_gguf(fmt: str, path: str) -> str:
    """A GGUF file of `fmt` rows (tests/gguf_files.py's writer, as llama.cpp's converter writes one)."""
    from pathlib import Path

    import gguf_files as gf

    arch, shape = GGUF_SHAPES[fmt]
    return str(gf.write_gguf(gf.tiny_model(arch, seed=zlib.crc32(fmt.encode()), **shape), Path(path), fmt))


def save_pack(plans, weights, path: str) -> int:
    """The constants `plans` read from `weights`, as the runners take them (`host_constant`), into one .npz: each
    checkpoint-rows constant as stored, each values constant f32. Its size in bytes."""
    arrays, formats = {}, {}
    for s in plans:
        for c in s.constants.values():
            src = c.source or c.name
            if src in arrays:
                continue
            if c.kind == "values":
                arrays[src], formats[src] = np.asarray(weights.get(src), dtype=np.float32), "f32"
            else:
                raw, fmt = weights.raw(src)
                arrays[src], formats[src] = np.ascontiguousarray(raw), fmt
    keyed = {f"w{i}": a for i, a in enumerate(arrays.values())}  # names as keys of their own (no '/' in a zip)
    np.savez_compressed(path, __index__=np.array(json.dumps({"names": list(arrays), "formats": formats})), **keyed)
    return os.path.getsize(path)


def _save_plans(out: str, stem: str, cfg, weights, numerics: str = "f32", batch: bool = False) -> dict:
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.lower.planfile import save

    src = {"kind": "pack", "path": stem}
    # launches nearly free in a mixture's chunk, so its plan sorts the rows by expert on so small a model
    chunk_knobs = Knobs(launch_us=0.01, fixed_scale=0.001) if cfg.moe is not None else Knobs()
    plans = {"decode": plan(build_step(cfg, 1), numerics=numerics, source=src),
             "prefill8": plan(build_step(cfg, 8), numerics=numerics, knobs=chunk_knobs, source=src)}
    if batch:
        plans["b8"] = plan(build_step(cfg, 1, batch=BATCH_SLOTS), numerics=numerics, source=src)
    files = {}
    for k, s in plans.items():
        files[k] = f"{stem}-{k}.json"
        save(s, os.path.join(out, files[k]))
    return {"plans": files, "_plans": list(plans.values())}


def prepare(out: str, names=None, log=print) -> dict:
    """Make, plan and pack the models `names` (default every one: `model_names()`) into folder `out`; the manifest
    (also written to out/families.json, merged with one there). A GGUF format's models (one a numerics) share one
    pack, written once all of them are planned."""
    import tempfile

    from lanefuse.engine.front.load import load_model

    os.makedirs(out, exist_ok=True)
    names = list(names or model_names())
    manifest = read_manifest(out)
    ggufs: dict[str, list[str]] = {}
    for name in names:
        if name.startswith("gguf-"):
            ggufs.setdefault(name.split("-")[1], []).append(name)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if not name.startswith("fam-"):
                continue
            fam = name[4:]
            folder = os.path.join(tmp, fam)
            hf = build_family(fam, folder)
            cfg, w = load_model(folder)
            entry = _save_plans(out, name, cfg, w, batch=fam == BATCH_FAMILY)
            size = save_pack(entry.pop("_plans"), w, os.path.join(out, f"{name}.npz"))
            entry.update(what=f"{FAMILIES[fam][0]}: {FAMILIES[fam][4]}", config=hf, max_len=cfg.max_len,
                         pack=f"{name}.npz")
            manifest[name] = entry
            log(f"{name}: {entry['what']}; {', '.join(entry['plans'].values())}, {entry['pack']} "
                f"({size / 1e6:.2f} MB)")
        for fmt, group in ggufs.items():
            cfg, w = load_model(build_gguf(fmt, os.path.join(tmp, f"{fmt}.gguf")))
            plans = []
            for name in group:
                entry = _save_plans(out, name, cfg, w, numerics=name.split("-")[2])
                plans += entry.pop("_plans")
                entry.update(what=f"GGUF {fmt} rows ({GGUF_SHAPES[fmt][0]}), --numerics {name.split('-')[2]}",
                             pack=f"gguf-{fmt}.npz")
                manifest[name] = entry
            size = save_pack(plans, w, os.path.join(out, f"gguf-{fmt}.npz"))
            log(f"{', '.join(group)}: GGUF {fmt} rows; gguf-{fmt}.npz ({size / 1e6:.2f} MB)")
    with open(os.path.join(out, "families.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


# -- the GPU side (and the CPU's check of it): saved plans and packs run ---------------------------------------------

class Pack:
    """A model's constants from a `save_pack` file: the weight store's `raw` / `get` / `shape` / `format`, which is
    all the runners and the saved-plan check ask of one."""

    def __init__(self, path: str):
        with np.load(path, allow_pickle=False) as z:
            index = json.loads(str(z["__index__"]))
            self.arrays = {n: z[f"w{i}"] for i, n in enumerate(index["names"])}
        self.formats = index["formats"]

    def raw(self, name: str):
        return self.arrays[name], self.formats[name]

    def get(self, name: str) -> np.ndarray:
        from lanefuse.kernels.common import decode

        a, fmt = self.raw(name)
        return np.asarray(decode(a, fmt), dtype=np.float32)

    def shape(self, name: str) -> tuple[int, ...]:
        a, fmt = self.raw(name)
        if fmt in ("q8_0", "q4_0", "q4_k", "q6_k", "mxfp4"):
            from lanefuse.engine.front.weights import block_shape

            return block_shape(name, a.shape, fmt)
        return tuple(a.shape)

    def format(self, name: str) -> str:
        return self.formats[name]


def read_manifest(plans_dir: str) -> dict:
    path = os.path.join(plans_dir or "", "families.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def load_unchecked(path: str):
    """The plan saved at `path` decoded without lane/lower/plancheck.py's check (planfile.load's decoding, the
    check left out): for a plan the check refuses wrongly, so the device still runs it."""
    from lanefuse.lane.lower.plan import Plan
    from lanefuse.lane.lower.plancheck import Decoder
    from lanefuse.lane.lower.planfile import _classes

    with open(path, encoding="utf-8") as f:
        return Decoder(_classes()).record(json.load(f)["plan"], Plan, "")


def load_model_plans(plans_dir: str, name: str):
    """Model `name`'s saved plans (by kind: decode, prefill8, b8) and its pack, each plan checked against the pack
    (every constant's shape and format). A plan the plan check refuses is decoded unchecked (`load_unchecked`) and
    the refusal kept in the entry's `check_errors`: the caller decides."""
    from lanefuse.engine.errors import UserError
    from lanefuse.lane.lower.planfile import load
    from lanefuse.lane.run.constants import check_constants

    entry = dict(read_manifest(plans_dir)[name])
    pack = Pack(os.path.join(plans_dir, entry["pack"]))
    plans, errors = {}, []
    for k, f in entry["plans"].items():
        path = os.path.join(plans_dir, f)
        try:
            plans[k] = load(path)
        except UserError as e:
            errors.append(str(e))
            plans[k] = load_unchecked(path)
        check_constants(plans[k], pack)
    entry["check_errors"] = errors
    return plans, pack, entry


def tables_of(s) -> dict[str, np.ndarray]:
    """Zeroed carried tables of plan `s` (KV caches, a family's carried states), as its tensors shape them."""
    return {n: np.zeros(s.tensors[n].shape, dtype=np.float32) for n in s.io.tables}


def run_tokens(runner, s, prompt=PROMPT, n: int = N_TOKENS) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decode with decode plan `s` on `runner`: the prompt a row at a time, then `n` tokens; the tokens and
    the logits each was taken from."""
    tables = tables_of(s)
    toks, logits = [], []
    feed, pos = list(prompt), 0
    while len(toks) < n:
        env = dict(tables)
        env[s.io.token] = np.array([feed[pos] if pos < len(feed) else toks[-1]], np.int32)
        env[s.io.position] = np.array([pos], np.int32)
        out = runner.step(env)
        pos += 1
        if pos >= len(feed):
            toks.append(int(np.asarray(out[s.io.next]).reshape(-1)[0]))
            logits.append(np.asarray(out[s.io.logits], dtype=np.float32).reshape(-1).copy())
    return toks, logits


def run_chunk(runner, s, tokens=CHUNK) -> np.ndarray:
    """The logits (its last row's) of one prefill chunk (plan `s` of len(tokens) rows) from position 0 on zeroed
    tables."""
    env = tables_of(s)
    env[s.io.token] = np.asarray(tokens, np.int32)
    env[s.io.position] = np.array([0], np.int32)
    return np.asarray(runner.step(env)[s.io.logits], dtype=np.float32).reshape(-1)


def margin(logits: np.ndarray) -> float:
    """The gap between a step's top two logits over its largest |logit|."""
    a, b = np.sort(logits)[-2:]
    return float(b - a) / max(float(np.abs(logits).max()), 1e-30)


def compare_tokens(got, want, tol: float, least: int = 8) -> tuple[int, float]:
    """Tokens and logits of two runs (`got`, `want`: (tokens, logits)): the same tokens, each step's logits within
    `tol` of their scale — up to a step where `want`'s top two were within `tol` (a near tie, where the two may
    part): past it nothing is compared. How many steps were compared, and the largest scaled logit difference."""
    err, steps = 0.0, 0
    for i, (tg, tw, lg, lw) in enumerate(zip(got[0], want[0], got[1], want[1])):
        e = float(np.abs(lg - lw).max() / np.abs(lw).max())
        assert e < tol, f"step {i}: logits differ by {e:.3g} of their scale (tolerance {tol})"
        err, steps = max(err, e), i + 1
        if tg != tw:
            assert margin(lw) < 2 * tol, f"step {i}: token {tg} against {tw}, top-two margin {margin(lw):.3g}"
            break
    assert steps >= min(least, len(want[0])), f"only {steps} steps compared"
    return steps, err


def run_batch(plans, pack, entry, device: str = "cpu", eos=(), graph: bool = True):
    """The batch family's 12 prompts in 8 slots that refill (lane/run/batch.py's generate_batch: a sequence ends at
    its BATCH_TOKENS-th token or at an id of `eos`), each prompt prefilled alone a row at a time with the decode plan
    into its slot, then decoded by the batch step ("b8") with the others. On `device` "gpu" the CuPy runners: the
    one-sequence caches and the slots on the device sharing the weights, a prefilled prompt's caches copied into its
    slot (as lane/run/step.py's plan_step_fn). The results, by prompt."""
    import dataclasses

    from lanefuse.engine.front.hfconfig import config_from_hf
    from lanefuse.lane.run.batch import generate_batch

    cfg = config_from_hf(entry["config"], "config.json", max_len=entry["max_len"], name="batch")
    cfg = dataclasses.replace(cfg, formats=tuple(pack.formats.items()))
    made: dict = {}
    if device == "gpu":
        from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState, slot_copier

        state, bstate = DeviceState(), DeviceState()
        bstate.weights = state.weights

    def step_fn(g, env):
        kind = "b8" if int(g.meta.get("batch", 1)) > 1 else "decode"
        assert kind == "b8" or int(g.meta.get("rows", 1)) == 1, "the batch prefills a row a step"
        if kind not in made:
            if device == "gpu":
                made[kind] = CupyRunner(plans[kind], pack, bstate if kind == "b8" else state, graph=graph)
            else:
                from lanefuse.lane.run.numpy_runner import NumpyRunner

                made[kind] = NumpyRunner(plans[kind], pack)
        return made[kind].step(env)

    if device == "gpu":
        step_fn.to_slot = slot_copier(state, bstate)
    prompts = [[t % cfg.vocab for t in p] for p in BATCH_PROMPTS]
    return generate_batch(cfg, pack, prompts, BATCH_TOKENS, BATCH_SLOTS, step_fn=step_fn, eos=eos, chunk=1)


def check_model(plans, pack, make_gpu, tol: float = 1e-3) -> str:
    """Decode plan: the prompt and 32 greedy tokens on the numpy runner (exact twins) and on `make_gpu(plan, pack)`,
    the same tokens and logits within `tol` of their scale (`compare_tokens`); prefill plan: the chunk's logits
    within `tol`. A line saying what was compared."""
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    dec, pre = plans["decode"], plans["prefill8"]
    want = run_tokens(NumpyRunner(dec, pack), dec)
    got = run_tokens(make_gpu(dec, pack), dec)
    steps, err = compare_tokens(got, want, tol)
    a = run_chunk(NumpyRunner(pre, pack), pre)
    b = run_chunk(make_gpu(pre, pack), pre)
    chunk_err = float(np.abs(a - b).max() / np.abs(a).max())
    assert chunk_err < tol, f"the 8-row chunk's logits differ by {chunk_err:.3g} of their scale"
    return (f"{steps} of {len(want[0])} tokens the same ({len(set(want[0]))} distinct), logits within {err:.2g}; "
            f"8-row chunk within {chunk_err:.2g}; {dec.n_launches} + {pre.n_launches} launches")


def check_batch(plans, pack, entry, tol: float = 1e-3, graph: bool = True) -> str:
    """The batch family's prompts in 8 slots that refill (`run_batch`), numpy against the device: each prompt's
    tokens the same (`compare_tokens`), some ending early at an end id so their slots refill mid-batch."""
    first = run_batch(plans, pack, entry, "cpu")
    eos = (first[0].generated_ids[2], first[2].generated_ids[0])  # prompt 0 ends at its 3rd token, prompt 2 at once
    want = run_batch(plans, pack, entry, "cpu", eos=eos)
    got = run_batch(plans, pack, entry, "gpu", eos=eos, graph=graph)
    early = sum(len(r.generated_ids) < BATCH_TOKENS for r in want)
    assert early >= 2, "no sequence ended early: the slots did not refill mid-batch"
    worst = 0.0
    for k, (g, w) in enumerate(zip(got, want)):
        n = min(len(g.generated_ids), len(w.generated_ids))
        _, err = compare_tokens((g.generated_ids[:n], g.logits[:n]), (w.generated_ids[:n], w.logits[:n]), tol,
                                least=1)
        worst = max(worst, err)
    return (f"{len(want)} prompts in {BATCH_SLOTS} slots, {early} ending early at an end id: the same tokens, "
            f"logits within {worst:.2g}")
