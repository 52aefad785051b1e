"""Real CPU ranks: R processes (lane/run/ranks.launch) each running its rank's step graphs — by the reference
interpreter, or its plan for the cuda lane by the numpy backend — with torch.distributed's gloo, against transformers
and the one-rank run: tiny random Qwen3 (f32) and Llama (bf16, tied embeddings) saved with
save_pretrained, a 6-token prompt in chunks of 4 (a 4-row and a 2-row prefill chunk), then decode; R = 2 and 3 (FFN and
vocabulary parts uneven). The exact communicator gives the reference interpreter's bits (its R threads'), gloo's own
all-reduce the same tokens within f32 rounding; a rank that dies ends the run in one line, no hang. NCCL's
communicator runs only where CuPy and two GPUs are (skips otherwise). The models and runs are tables in
tests/ranks_helpers.py (HF_MODELS, DENSE_RUNS); the runs of one rank count of the three gloo files are one launch."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.lane.run.ranks import joined_logits, launch  # noqa: E402
from ranks_helpers import DENSE_RUNS, GLOO, check_run, gloo_run, job, model_reference, thread_ranks  # noqa: E402

pytestmark = GLOO


@pytest.mark.parametrize("ranks", [2, 3])
def test_gloo_ranks_give_one_ranks_tokens(tmp_path_factory, ranks):
    """Qwen3 and Llama, each way of stepping (tests/ranks_helpers.DENSE), over 2 and 3 ranks."""
    for (name, what), (n_tokens, _) in DENSE_RUNS[ranks].items():
        by_rank, m = gloo_run(ranks, (name, what), tmp_path_factory)
        # all-reduces a step: 2 a layer; a gathered next token: 1; of 2 prefill chunks and N - 1 decode steps
        check_run(by_rank, m, f"{name} {what}", calls=(2 + n_tokens - 1) * (2 * 2 + 1))
        if what == "exact":  # the real library's collectives give the reference interpreter's R ranks' bits
            ref = joined_logits(thread_ranks(ranks, m["folder"], n_tokens))
            assert all(np.array_equal(a, b) for a, b in zip(joined_logits(by_rank), ref))


def test_a_dying_rank_ends_every_rank(tmp_path_factory):
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"rank 1 of 2 died") as e:
        launch(2, [job(model_reference("qwen3_f32", 10, tmp_path_factory), 10, die_rank=1, stop_after=3)],
               timeout=20.0)
    assert "\n" not in str(e.value)
    print(f"\na dying rank: '{e.value}' after {time.perf_counter() - t0:.1f} s")


def test_refused_rank_count_is_one_line(tmp_path_factory):
    with pytest.raises(UserError, match=r"rank \d of 4: --ranks 4: 4 ranks do not divide .* 6 KV heads"):
        launch(4, [job(model_reference("qwen3_f32", 10, tmp_path_factory), 2)])


@pytest.mark.gpu
def test_nccl_ranks(tmp_path_factory):
    cupy = pytest.importorskip("cupy")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver: no device
        n = 0
    if n < 2:
        pytest.skip(f"NCCL ranks need 2 GPUs ({n} here)")
    m = model_reference("qwen3_f32", 10, tmp_path_factory)
    res = launch(2, [job(m, 10)], backend="nccl")
    assert all(r["tokens"] == m["hf_tokens"] for r in res[0])
