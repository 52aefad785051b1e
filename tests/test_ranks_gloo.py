"""Real CPU ranks: R processes (lane/run/ranks.launch) each running its rank's step graphs — by the reference
interpreter, or its plan for the cuda lane by the numpy backend — with torch.distributed's gloo, against transformers
and the one-rank run: tiny random Qwen3 (f32) and Llama (bf16, tied embeddings) saved with
save_pretrained, a 6-token prompt in chunks of 4 (a 4-row and a 2-row prefill chunk), then decode; R = 2 and 3 (FFN and
vocabulary parts uneven). The exact communicator gives the reference interpreter's bits (its R threads'), gloo's own
all-reduce the same tokens within f32 rounding; a rank that dies ends the run in one line, no hang. NCCL's
communicator runs only where CuPy and two GPUs are (skips otherwise)."""

from __future__ import annotations

import threading
import time
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_ref import hf_greedy, scaled_error  # noqa: E402
from lanefuse.engine.collectives import LocalComm  # noqa: E402
from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from lanefuse.lane.run.generate import generate  # noqa: E402
from lanefuse.lane.run.ranks import gloo_missing, joined_logits, launch, rank_generate  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow,
              pytest.mark.skipif(gloo_missing() is not None, reason=f"CPU ranks need gloo: {gloo_missing()}")]

PROMPT = [3, 17, 5, 42, 8, 11]
N_TOKENS = 10
CHUNK = 4
MODELS = {
    # 6 KV heads: split over 2 and over 3 ranks; FFN 70 (35 / 24, 23, 23), vocabulary 101 (51, 50 / 34, 34, 33)
    "qwen3_f32": ("Qwen3Config", dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=12,
                                      num_key_value_heads=6, head_dim=8, intermediate_size=70, vocab_size=101),
                  "float32"),
    "llama_tied_bf16": ("LlamaConfig", dict(hidden_size=54, num_hidden_layers=2, num_attention_heads=6,
                                            num_key_value_heads=6, head_dim=8, intermediate_size=37, vocab_size=97,
                                            tie_word_embeddings=True), "bfloat16"),
}


def _save(name: str, folder):
    cls_name, kw, dtype = MODELS[name]
    cfg = getattr(transformers, cls_name)(max_position_embeddings=64, **kw)
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    torch.manual_seed(zlib.crc32(name.encode()))
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p) * (0.1 if cfg.tie_word_embeddings else 1.0))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return model_cls.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each model's folder, transformers' tokens and logits, and the one-rank run's."""
    out = {}
    for name in MODELS:
        folder = tmp_path_factory.mktemp("ranks") / name
        ref = _save(name, folder)
        toks, logits = hf_greedy(ref, PROMPT, N_TOKENS)
        cfg, w = load_model(folder, max_len=32)
        one = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK)
        out[name] = dict(folder=str(folder), hf_tokens=toks, hf_logits=logits, one=one)
    return out


def _threads(ranks: int, folder: str) -> list[dict]:
    """The reference interpreter of R ranks (a thread a rank, engine/collectives.LocalComm) over the same runs."""
    group = LocalComm(ranks)
    got: list = [None] * ranks

    def run(r):
        got[r] = rank_generate(group.at(r), folder, PROMPT, N_TOKENS, CHUNK, max_len=32)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return got


VARIANTS = {"exact": dict(exact=True), "gloo all-reduce": dict(exact=False),
            "numpy plan": dict(exact=True, plan=True)}  # the rank's plan for the cuda lane, the numpy backend's twins


@pytest.mark.parametrize("ranks", [2, 3])
def test_gloo_ranks_give_one_ranks_tokens(models, ranks):
    jobs = [dict(model=m["folder"], prompt=PROMPT, n_tokens=N_TOKENS, chunk=CHUNK, max_len=32, **v)
            for m in models.values() for v in VARIANTS.values()]
    t0 = time.perf_counter()
    res = launch(ranks, jobs)
    print(f"\n{ranks} gloo ranks, {len(jobs)} runs: {time.perf_counter() - t0:.1f} s (process start-up included)")
    for k, (name, m) in enumerate(models.items()):
        for j, what in enumerate(VARIANTS):
            by_rank = res[len(VARIANTS) * k + j]
            for r in by_rank:
                assert r["tokens"] == m["hf_tokens"] == m["one"].generated_ids, (name, what)
            logits = joined_logits(by_rank)
            rel_one = scaled_error(logits, m["one"].logits)
            rel_hf = scaled_error(logits, m["hf_logits"])
            # all-reduces a step: 2 a layer; a gathered next token: 1; of 2 prefill chunks and N - 1 decode steps
            steps = 2 + N_TOKENS - 1
            assert all(r["calls"] == steps * (2 * 2 + 1) for r in by_rank)
            print(f"  {name} {what}: tokens equal; logits vs one rank {rel_one:.1e}, vs transformers {rel_hf:.1e} of "
                  f"their scale; {by_rank[0]['bytes']} B sent a rank")
            assert rel_one < 1e-5 and rel_hf < 1e-4
            if what == "exact":  # the real library's collectives give the reference interpreter's R ranks' bits
                ref = joined_logits(_threads(ranks, m["folder"]))
                assert all(np.array_equal(a, b) for a, b in zip(logits, ref))


def test_a_dying_rank_ends_every_rank(models):
    m = models["qwen3_f32"]
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"rank 1 of 2 died") as e:
        launch(2, [dict(model=m["folder"], prompt=PROMPT, n_tokens=N_TOKENS, chunk=CHUNK, max_len=32,
                        die_rank=1, stop_after=3)], timeout=20.0)
    assert "\n" not in str(e.value)
    print(f"\na dying rank: '{e.value}' after {time.perf_counter() - t0:.1f} s")


def test_refused_rank_count_is_one_line(models):
    with pytest.raises(UserError, match=r"rank \d of 4: --ranks 4: 4 ranks do not divide .* 6 KV heads"):
        launch(4, [dict(model=models["qwen3_f32"]["folder"], prompt=PROMPT, n_tokens=2, chunk=CHUNK, max_len=32)])


@pytest.mark.gpu
def test_nccl_ranks(models):
    cupy = pytest.importorskip("cupy")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver: no device
        n = 0
    if n < 2:
        pytest.skip(f"NCCL ranks need 2 GPUs ({n} here)")
    m = models["qwen3_f32"]
    res = launch(2, [dict(model=m["folder"], prompt=PROMPT, n_tokens=N_TOKENS, chunk=CHUNK, max_len=32)],
                 backend="nccl")
    assert all(r["tokens"] == m["hf_tokens"] for r in res[0])
