"""Real CPU ranks: R processes (lane/run/ranks.launch) each running its rank's step graphs — by the reference
interpreter, or its plan for the cuda lane by the numpy backend — with torch.distributed's gloo, against transformers
and the one-rank run: tiny random Qwen3 (f32) and Llama (bf16, tied embeddings) saved with
save_pretrained, a 6-token prompt in chunks of 4 (a 4-row and a 2-row prefill chunk), then decode; R = 2 and 3 (FFN and
vocabulary parts uneven). The exact communicator gives the reference interpreter's bits (its R threads'), gloo's own
all-reduce the same tokens within f32 rounding; a rank that dies ends the run in one line, no hang. NCCL's
communicator runs only where CuPy and two GPUs are (skips otherwise)."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.lane.run.ranks import joined_logits, launch  # noqa: E402
from ranks_helpers import GLOO, Launches, check_run, hf_reference, job, thread_ranks  # noqa: E402

pytestmark = GLOO

N_TOKENS = 10
NAMES = ("qwen3_f32", "llama_tied_bf16")  # tests/ranks_helpers.HF_MODELS
VARIANTS = {"exact": dict(exact=True), "gloo all-reduce": dict(exact=False),
            "numpy plan": dict(exact=True, plan=True)}  # the rank's plan for the cuda lane, the numpy backend's twins


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each model's folder, transformers' tokens and logits, and the one-rank run's."""
    return {name: hf_reference(name, N_TOKENS, tmp_path_factory) for name in NAMES}


@pytest.fixture(scope="module")
def runs(models):
    """Every model and variant over 2 ranks in one launch, and over 3 in another."""
    return Launches({ranks: {(name, what): job(m, N_TOKENS, **v) for name, m in models.items()
                             for what, v in VARIANTS.items()} for ranks in (2, 3)})


@pytest.mark.parametrize("ranks", [2, 3])
def test_gloo_ranks_give_one_ranks_tokens(models, runs, ranks):
    for name, m in models.items():
        for what in VARIANTS:
            by_rank = runs(ranks, (name, what))
            # all-reduces a step: 2 a layer; a gathered next token: 1; of 2 prefill chunks and N - 1 decode steps
            check_run(by_rank, m, f"{name} {what}", calls=(2 + N_TOKENS - 1) * (2 * 2 + 1))
            if what == "exact":  # the real library's collectives give the reference interpreter's R ranks' bits
                ref = joined_logits(thread_ranks(ranks, m["folder"], N_TOKENS))
                assert all(np.array_equal(a, b) for a, b in zip(joined_logits(by_rank), ref))


def test_a_dying_rank_ends_every_rank(models):
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"rank 1 of 2 died") as e:
        launch(2, [job(models["qwen3_f32"], N_TOKENS, die_rank=1, stop_after=3)], timeout=20.0)
    assert "\n" not in str(e.value)
    print(f"\na dying rank: '{e.value}' after {time.perf_counter() - t0:.1f} s")


def test_refused_rank_count_is_one_line(models):
    with pytest.raises(UserError, match=r"rank \d of 4: --ranks 4: 4 ranks do not divide .* 6 KV heads"):
        launch(4, [job(models["qwen3_f32"], 2)])


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
    res = launch(2, [job(m, N_TOKENS)], backend="nccl")
    assert all(r["tokens"] == m["hf_tokens"] for r in res[0])
