"""What the rank tests (tests/test_ranks*.py) share. In process: a toy config's matrices in a weight format, its
random weights, R ranks' step against the one-rank step after a 3-row chunk (the reference interpreter), each rank's
plan run by the numpy backend with the ranks meeting through LocalComm, and the comparison of the ranks' logits parts
and tokens with the whole. Over real CPU ranks (gloo): the tiny transformers models saved once a process with
transformers' greedy tokens and the one-rank run's, every gloo test's runs of one rank count made by one `launch` (one
set of rank processes), and a run's comparison with its references."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
import zlib

import numpy as np
import pytest

from lanefuse.engine.front.model import build_step
from lanefuse.engine.front.parallel import build_rank_step, rank_config, rank_weights
from lanefuse.engine.front.stepweights import random_weights
from lanefuse.engine.interp import evaluate
from lanefuse.engine.ranks import evaluate_ranks
from lanefuse.lane.run.generate import new_caches
from lanefuse.lane.run.ranks import gloo_missing

# -- in process ------------------------------------------------------------------------------------------------------


def in_format(cfg, fmt: str):
    """`cfg` with its matrices (2-D weights) stored in `fmt`; f32 as it is."""
    if fmt == "f32":
        return cfg
    return dataclasses.replace(cfg, formats=tuple((n, fmt) for n, s in cfg.weight_names().items() if len(s) == 2))


def seeded_weights(cfg, seed: int):
    """front/stepweights' random weights of the step, each constant in its format."""
    return random_weights(build_step(cfg, 1), seed).with_config(cfg)


def stored_weights(cfg, seed: int = 3, embed: float = 1.0, vector: float = 10.0):
    """Random weights under the checkpoint's names (a family's own: the norms' 1 + w generated from them, stacked
    experts and their biases), matrices scaled by 1/sqrt(columns), `embed` times the embedding's, 1-D weights divided
    by `vector`; matrices encoded in the config's formats."""
    from lanefuse.engine.formats.blocks import encode
    from lanefuse.engine.front.weights import Weights

    r = np.random.default_rng(seed)
    arrays = {}
    for n, sh in cfg.weight_names().items():
        a = (r.standard_normal(sh) * (embed if "embed" in n else 1.0) / (sh[-1] ** 0.5 if len(sh) == 2 else vector))
        a = a.astype(np.float32)
        arrays[n] = (encode(a, cfg.fmt(n)), cfg.fmt(n)) if len(sh) == 2 and cfg.fmt(n) != "f32" else a
    return Weights.from_dict(arrays, cfg)


def env(cfg, tokens, pos: int = 0) -> dict:
    """A step's inputs: the tokens at `pos`, and empty caches of `cfg` (a rank's config: its KV heads)."""
    return {"token": np.asarray(tokens, np.int32), "pos": np.asarray([pos], np.int32), **new_caches(cfg)}


def in_threads(ranks: int, fn) -> list:
    """fn(r) for each rank r, a thread a rank (ranks meeting through a LocalComm block until all have come)."""
    got: list = [None] * ranks

    def run(r):
        got[r] = fn(r)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return got


@dataclasses.dataclass
class AfterAChunk:
    """A step of len(toks) rows at position 3 after a 3-row chunk, by one rank and by R ranks (the reference
    interpreter): the one rank's environment (its caches) and outputs, the ranks' graphs, environments and outputs."""
    one: dict
    want: dict
    graphs: list
    envs: list
    got: list


def after_a_chunk(cfg, w, ranks: int, toks, first=(4, 9, 2)) -> AfterAChunk:
    """A 3-row chunk of `first`, then `toks` at position 3, by the one-rank step and by R ranks' steps."""
    one = env(cfg, first)
    evaluate(build_step(cfg, 3), w, one)
    one.update(token=np.asarray(toks, np.int32), pos=np.asarray([3], np.int32))
    want = evaluate(build_step(cfg, len(toks)), w, one)
    ws = [rank_weights(w, cfg, r, ranks) for r in range(ranks)]
    envs = [env(rank_config(cfg, r, ranks), first) for r in range(ranks)]
    evaluate_ranks([build_rank_step(cfg, r, ranks, 3) for r in range(ranks)], ws, envs)
    for e in envs:
        e.update(token=np.asarray(toks, np.int32), pos=np.asarray([3], np.int32))
    gs = [build_rank_step(cfg, r, ranks, len(toks)) for r in range(ranks)]
    return AfterAChunk(one, want, gs, envs, evaluate_ranks(gs, ws, envs))


def last_row(out: dict) -> np.ndarray:
    """An output's last row of logits (1, its vocabulary or vocabulary part)."""
    logits = np.asarray(out["logits"])
    return logits.reshape(-1, logits.shape[-1])[-1:]


def assert_same_step(got: list[dict], want, tol: float = 1e-5) -> float:
    """The ranks' last logits rows side by side within `tol` of the scale of `want`'s (one rank's outputs, or R
    ranks' joined), and every rank's next token `want`'s; returns that scale."""
    whole = np.concatenate([last_row(o) for o in want], axis=-1) if isinstance(want, list) else last_row(want)
    scale = float(np.abs(whole).max())
    joined = np.concatenate([last_row(o) for o in got], axis=-1)
    assert float(np.abs(joined - whole).max()) <= tol * scale
    token = np.asarray((want[0] if isinstance(want, list) else want)["next"]).reshape(-1)
    for o in got:
        np.testing.assert_array_equal(np.asarray(o["next"]).reshape(-1), token)
    return scale


def run_plans(plans, ws, envs, exact: bool = True) -> list[dict]:
    """Each rank's plan run by the numpy backend (its exact twins, or the fast ones) on its environment, the
    collective launches meeting through a LocalComm."""
    from lanefuse.engine.collectives import LocalComm
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    group = LocalComm(len(plans))

    def run(r):
        runner = NumpyRunner(plans[r], ws[r], exact=exact)
        runner.env.comm = group.at(r)
        return runner.step(envs[r])

    return in_threads(len(plans), run)


@functools.lru_cache(maxsize=1)
def rule_table():
    """The shared rule table (engine/rules.load_table), read once a process: plan() without one reads and expands
    the rules' YAML anew each call (0.13 s of a toy rank step's 0.3 s plan)."""
    from lanefuse.engine.rules import load_table

    return load_table()


class RankPlans:
    """R ranks' step of `toks` at position 0: each rank's graph and weights, the reference interpreter's outputs
    (`want`), and each rank's plan for the cuda lane (`plans`: plan() with `plan_kw`, made when first asked for)."""

    def __init__(self, cfg, w, ranks: int, toks, **plan_kw):
        self.cfg, self.ranks, self.toks, self.plan_kw = cfg, ranks, np.asarray(toks, np.int32), plan_kw
        self.graphs = [build_rank_step(cfg, r, ranks, len(self.toks)) for r in range(ranks)]
        self.weights = [rank_weights(w, cfg, r, ranks) for r in range(ranks)]
        self.want = evaluate_ranks(self.graphs, self.weights, self.envs())
        self._plans = None

    def envs(self) -> list[dict]:
        """Each rank's inputs, its caches empty."""
        return [env(rank_config(self.cfg, r, self.ranks), self.toks) for r in range(self.ranks)]

    @property
    def plans(self) -> list:
        if self._plans is None:
            from lanefuse.lane.lower.plan import plan

            self._plans = [plan(g, table=rule_table(), **self.plan_kw) for g in self.graphs]
        return self._plans

    def run(self, exact: bool = True) -> list[dict]:
        """The plans run by the numpy backend (run_plans) on fresh inputs."""
        return run_plans(self.plans, self.weights, self.envs(), exact)

    def check(self, exact: bool = True) -> None:
        """The plans' run gives the reference ranks' next token and logits (assert_same_step)."""
        assert_same_step(self.run(exact), self.want)


# -- real CPU ranks ---------------------------------------------------------------------------------------------------

GLOO = [pytest.mark.hf, pytest.mark.slow,
        pytest.mark.skipif(gloo_missing() is not None, reason=f"CPU ranks need gloo: {gloo_missing()}")]
PROMPT = [3, 17, 5, 42, 8, 11]  # a 4-row and a 2-row prefill chunk, then decode
CHUNK = 4
MAX_LEN = 32


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread while it builds and runs the tiny references: its intra-op threads on a shared, loaded
    machine make a tiny op wait on the others (a mixture's index_add_ took 46 ms a call on 2 threads, 0.1 ms on 1)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _init_plain(pname, p, cfg):
    """Norms near 1, an embedding of unit rows (a tied one small), matrices of unit rows' outputs."""
    import torch

    if "norm" in pname:
        return 1.0 + 0.1 * torch.randn_like(p)
    if "embed_tokens" in pname:
        return torch.randn_like(p) * (0.1 if cfg.tie_word_embeddings else 1.0)
    return torch.randn_like(p) / p.shape[1] ** 0.5


def _init_family(pname, p, cfg):
    """Gemma's norms (1 + w) around 1.5, its embedding small (it is scaled by sqrt(hidden)); other 1-D weights small."""
    import torch

    gemma = cfg.model_type.startswith("gemma")
    if "norm" in pname:
        return (0.5 + 0.3 * torch.randn_like(p)) if gemma else (1.0 + 0.1 * torch.randn_like(p))
    if "embed_tokens" in pname:
        return torch.randn_like(p) * (0.05 if gemma else 1.0)
    if p.ndim == 2:
        return torch.randn_like(p) / p.shape[1] ** 0.5
    return 0.1 * torch.randn_like(p)


def _init_mixture(pname, p, cfg):
    """Scales that keep the residual alive and the routing decisive (the routers' rows three times the others')."""
    import torch

    if p.dim() == 1 or "norm" in pname:
        return 1.0 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.1 * torch.randn_like(p)
    if "embed_tokens" in pname:
        return torch.randn_like(p)
    if pname.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
        return 3 * torch.randn_like(p) / p.shape[-1] ** 0.5
    return torch.randn_like(p) / p.shape[-1] ** 0.5


_SMALL_MOE = dict(hidden_size=32, num_hidden_layers=2, head_dim=8, intermediate_size=37, vocab_size=61)
# name: (transformers config class, model class, its keywords, dtype, initialisation); every one 64 positions
HF_MODELS = {
    # 6 KV heads: split over 2 and over 3 ranks; FFN 70 (35 / 24, 23, 23), vocabulary 101 (51, 50 / 34, 34, 33)
    "qwen3_f32": ("Qwen3Config", "Qwen3ForCausalLM",
                  dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=6, head_dim=8,
                       intermediate_size=70, vocab_size=101), "float32", _init_plain),
    "llama_tied_bf16": ("LlamaConfig", "LlamaForCausalLM",
                        dict(hidden_size=54, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6,
                             head_dim=8, intermediate_size=37, vocab_size=97, tie_word_embeddings=True), "bfloat16",
                        _init_plain),
    "gemma2_f32": ("Gemma2Config", "Gemma2ForCausalLM",
                   dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=37, vocab_size=97, sliding_window=3, query_pre_attn_scalar=20,
                        attn_logit_softcapping=1.5, final_logit_softcapping=3.0), "float32", _init_family),
    "gemma3_bf16": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=29, vocab_size=101, sliding_window=3, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
                    "bfloat16", _init_family),
    "phi3_bf16": ("Phi3Config", "Phi3ForCausalLM",
                  dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=37, vocab_size=97, sliding_window=4, partial_rotary_factor=0.5,
                       pad_token_id=0), "bfloat16", _init_family),
    "phi3_f32": ("Phi3Config", "Phi3ForCausalLM",
                 dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                      intermediate_size=37, vocab_size=97, sliding_window=None, pad_token_id=0), "float32",
                 _init_family),
    "olmo2_bf16": ("Olmo2Config", "Olmo2ForCausalLM",
                   dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=37, vocab_size=97, eos_token_id=2, pad_token_id=0), "bfloat16",
                   _init_family),
    # a dense layer among the sparse ones, 7 experts; a shared expert, 6 experts; 5 experts (uneven parts)
    "qwen3_moe_f32": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(_SMALL_MOE, num_attention_heads=12, num_key_value_heads=6, num_experts=7,
                           num_experts_per_tok=2, moe_intermediate_size=20, norm_topk_prob=True, num_hidden_layers=3,
                           mlp_only_layers=[1]), "float32", _init_mixture),
    "qwen2_moe_bf16": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                       dict(_SMALL_MOE, num_attention_heads=8, num_key_value_heads=4, num_experts=6,
                            num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=24,
                            norm_topk_prob=False), "bfloat16", _init_mixture),
    "mixtral_bf16": ("MixtralConfig", "MixtralForCausalLM",
                     dict(_SMALL_MOE, num_attention_heads=8, num_key_value_heads=4, num_local_experts=5,
                          num_experts_per_tok=2), "bfloat16", _init_mixture),
}
_SAVED: dict[str, tuple] = {}  # name: (folder, transformers' f32 model of the saved weights), once a process
_REFERENCES: dict[tuple, dict] = {}  # (name, tokens): model_reference()'s answer


def hf_model(name: str, tmp_path_factory):
    """HF_MODELS[name] made by transformers with seeded weights, saved with save_pretrained in its dtype (once a
    process); its folder and transformers' f32 model of the saved weights."""
    if name not in _SAVED:
        import torch
        import transformers

        cfg_name, model_name, kw, dtype, init = HF_MODELS[name]
        cfg = getattr(transformers, cfg_name)(max_position_embeddings=64, **kw)
        model_cls = getattr(transformers, model_name)
        folder = tmp_path_factory.mktemp("ranks") / name
        with one_torch_thread():
            torch.manual_seed(zlib.crc32(name.encode()))
            model = model_cls(cfg).eval()
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    p.copy_(init(pname, p, cfg))
            model.to(getattr(torch, dtype)).save_pretrained(folder)
            load = dict(experts_implementation="eager") if init is _init_mixture else {}
            _SAVED[name] = (str(folder), model_cls.from_pretrained(folder, dtype=torch.float32, **load).eval())
    return _SAVED[name]


def reference(folder, ref, n_tokens: int) -> dict:
    """A checkpoint's references for `n_tokens` greedy tokens after PROMPT: its folder, transformers' tokens and
    logits (`ref`: transformers' model, or None), and the one-rank run's (lane/run/generate, chunks of CHUNK)."""
    from hf_ref import hf_greedy
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.generate import generate

    out = dict(folder=str(folder), hf_tokens=None, hf_logits=None)
    if ref is not None:
        with one_torch_thread():
            out["hf_tokens"], out["hf_logits"] = hf_greedy(ref, PROMPT, n_tokens)
    cfg, w = load_model(folder, max_len=MAX_LEN)
    out.update(cfg=cfg, one=generate(cfg, w, PROMPT, n_tokens, chunk=CHUNK))
    return out


def _built(name: str, folder):
    """The checkpoints other test files make: tests/test_deepseek.py's tiny DeepSeek-V3 (bf16),
    tests/test_gptoss.py's gpt-oss (f32) and tests/test_qwen3next.py's Qwen3-Next (bf16), saved by transformers (its
    model of them returned too), and tests/test_gguf_moe.py's llama.cpp mixtures (`arch-fmt.gguf`, no transformers
    model)."""
    if name == "deepseek":
        from test_deepseek import build

        return folder, build("bfloat16", folder)
    if name == "gptoss":
        from test_gptoss import build

        return folder, build("float32", folder)
    if name == "qnext":
        from test_qwen3next import build

        return build("bf16", folder)
    import gguf_files as gf
    from test_gguf_moe import _model

    arch, fmt = name.split("-")
    model = _model(arch, **({"num_attention_heads": 4, "num_key_value_heads": 2} if arch == "qwen3moe" else {}))
    return gf.write_gguf(model, folder.with_suffix(".gguf"), fmt), None


def model_reference(name: str, n_tokens: int, tmp_path_factory) -> dict:
    """reference() of HF_MODELS[name] or of a checkpoint _built() makes, once a process."""
    if (name, n_tokens) not in _REFERENCES:
        if name in HF_MODELS:
            made = hf_model(name, tmp_path_factory)
        else:
            with one_torch_thread():
                made = _built(name, tmp_path_factory.mktemp("ranks") / name)
        _REFERENCES[name, n_tokens] = reference(*made, n_tokens)
    return _REFERENCES[name, n_tokens]


EXACT, GLOO_SUM, PLAN = dict(exact=True), dict(exact=False), dict(exact=True, plan=True)
# the runs of the real-process tests by rank count: (model, what) -> (tokens, job keywords); `what` names the way
# each rank steps: its reference interpreter with the exact communicator, the same with gloo's own all-reduce, or
# its plan for the cuda lane on the numpy backend's exact twins
DENSE = {"exact": EXACT, "gloo all-reduce": GLOO_SUM, "numpy plan": PLAN}  # tests/test_ranks_gloo.py
DENSE_RUNS = {r: {(n, w): (10, v) for n in ("qwen3_f32", "llama_tied_bf16") for w, v in DENSE.items()}
              for r in (2, 3)}
FAMILY_RUNS = {2: {(n, "numpy plan"): (6, PLAN) for n in ("gemma2_f32", "gemma3_bf16", "phi3_bf16", "phi3_f32",
                                                           "olmo2_bf16")},
               4: {("phi3_bf16", "reference"): (6, EXACT)}}  # tests/test_ranks_gloo_families.py
MIXTURE = {"numpy plan": PLAN, "reference": EXACT}  # tests/test_ranks_gloo_moe.py
MIXTURE_RUNS = {r: {(n, w): (6, v) for n, rs in (("qwen3_moe_f32", (2, 3)), ("qwen2_moe_bf16", (2, 4)),
                                                  ("mixtral_bf16", (2, 4))) if r in rs for w, v in MIXTURE.items()}
                for r in (2, 3, 4)}
OTHER_RUNS = {2: {("deepseek", "numpy plan"): (6, PLAN), ("gptoss", "numpy plan"): (6, PLAN),
                  ("qnext", "numpy plan"): (6, PLAN),
                  ("qwen2moe-q8_0", "numpy plan"): (6, PLAN), ("qwen3moe-f32", "numpy plan"): (6, PLAN)},
              4: {("deepseek", "reference"): (6, EXACT)}}  # tests/test_ranks_gloo_moe.py
# three prompts in two slots (the third waits for a slot, taken mid-run), 5 tokens each: tests/test_ranks_batch.py
SLOTS_PROMPTS = [[3, 17, 5, 42, 8, 11], [9, 1, 30], [44, 2, 7, 19, 6]]
BATCH_RUNS = {2: {("qwen2_moe_bf16", "batch numpy plan"): (5, dict(PLAN, prompts=SLOTS_PROMPTS, slots=2))}}
GLOO_RUNS: dict[int, dict] = {}
for _runs in (DENSE_RUNS, FAMILY_RUNS, MIXTURE_RUNS, OTHER_RUNS, BATCH_RUNS):
    for _r, _jobs in _runs.items():
        GLOO_RUNS.setdefault(_r, {}).update(_jobs)
_LAUNCHED: dict[int, dict] = {}  # ranks: (model, what) -> its results by rank


def job(m: dict, n_tokens: int, **kw) -> dict:
    """A launch job: reference `m`'s checkpoint, n_tokens after PROMPT in chunks of CHUNK; `kw`: exact, plan, ..."""
    return dict(model=m["folder"], prompt=PROMPT, n_tokens=n_tokens, chunk=CHUNK, max_len=MAX_LEN, **kw)


def gloo_run(ranks: int, key, tmp_path_factory) -> tuple[list[dict], dict]:
    """Run `key` (model, what) of GLOO_RUNS over `ranks` gloo processes: its results by rank, and its model's
    references. Every run of that rank count, whichever test file asks for it, is made by ONE launch (one set of
    rank processes: each rank's start-up, imports and lane tables once) when a test first asks for one of them."""
    from lanefuse.lane.run.ranks import launch

    runs = GLOO_RUNS[ranks]
    if ranks not in _LAUNCHED:
        keys = list(runs)
        jobs = [job(model_reference(k[0], runs[k][0], tmp_path_factory), runs[k][0], **runs[k][1]) for k in keys]
        t0 = time.perf_counter()
        res = launch(ranks, jobs)
        print(f"\n{ranks} gloo ranks, {len(keys)} runs: {time.perf_counter() - t0:.1f} s (process start-up "
              f"included)")
        _LAUNCHED[ranks] = dict(zip(keys, res))
    return _LAUNCHED[ranks][key], model_reference(key[0], runs[key][0], tmp_path_factory)


def thread_ranks(ranks: int, folder: str, n_tokens: int) -> list[dict]:
    """R ranks' greedy run in this process (lane/run/ranks.rank_generate, the reference interpreter, a thread a rank
    meeting through engine/collectives.LocalComm)."""
    from lanefuse.engine.collectives import LocalComm
    from lanefuse.lane.run.ranks import rank_generate

    group = LocalComm(ranks)
    return in_threads(ranks, lambda r: rank_generate(group.at(r), folder, PROMPT, n_tokens, CHUNK, max_len=MAX_LEN))


def check_run(by_rank: list[dict], m: dict, what, calls: int | None = None) -> None:
    """A run over R ranks against its references `m`: every rank's tokens transformers' (where `m` has them) and the
    one-rank run's, the ranks' logits parts joined within f32 rounding of the one rank's (1e-5 of their scale) and of
    transformers' (1e-4); `calls`: the collectives each rank met."""
    from hf_ref import scaled_error
    from lanefuse.lane.run.ranks import joined_logits

    want = m["one"].generated_ids
    for r in by_rank:
        assert r["tokens"] == want, what
        assert m["hf_tokens"] is None or r["tokens"] == m["hf_tokens"], what
    logits = joined_logits(by_rank)
    rel_one = scaled_error(logits, m["one"].logits)
    rel_hf = None if m["hf_logits"] is None else scaled_error(logits, m["hf_logits"])
    print(f"  {what}: tokens equal; logits vs one rank {rel_one:.1e}"
          + ("" if rel_hf is None else f", vs transformers {rel_hf:.1e}") + f" of their scale; {by_rank[0]['calls']} "
          f"collectives, {by_rank[0]['bytes']} B sent a rank")
    assert rel_one < 1e-5, what
    assert rel_hf is None or rel_hf < 1e-4, what
    if calls is not None:
        assert all(r["calls"] == calls for r in by_rank), what
