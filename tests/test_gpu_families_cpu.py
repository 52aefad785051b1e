"""The CPU half of the GPU model tests (tests/test_gpu_model.py, tests/gpu_families.py), checked without a device:
bench/gpu_prepare.py's making of a family and of a GGUF format's models into a PLANDIR made here; each saved plan
loaded with its pack and run by the numpy runner against transformers (the pack holds what the front served); and
the GPU tests' own code — the decode loop, the chunk, the batch in slots that refill — run through the CuPy runner
over a stand-in `cupy` (tests/test_cupy_runner_mock.py: each launch's numpy twin), so on a device only the kernels
are new. Every family the front reads has a GPU model test."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_families as gfm
from test_cupy_runner_mock import fake_cupy  # noqa: F401  (the fixture)

CPU_MODELS = ["fam-llama", "gguf-q8_0-f32", "gguf-q8_0-q8"]  # the batch family and one GGUF format, both numerics


@pytest.fixture(scope="module")
def plandir(tmp_path_factory):
    pytest.importorskip("egglog")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    out = tmp_path_factory.mktemp("plans")
    gfm.prepare(str(out), CPU_MODELS, log=lambda *a: None)
    return str(out)


def test_every_family_the_front_reads_has_a_gpu_model_test():
    from lanefuse.engine.front.family import families

    read = {arch for f in families().values() for arch in f.hf}
    read.discard("Gemma3ForConditionalGeneration")  # its text model is Gemma3ForCausalLM's
    tested = {f"{stem}ForCausalLM" for stem, *_ in gfm.FAMILIES.values()}
    assert read <= tested, sorted(read - tested)
    assert set(gfm.GGUF_FORMATS) == {"q8_0", "q4_0", "q4_k", "q6_k"}


@pytest.mark.slow
def test_prepared_plans_load_and_their_packs_hold_what_they_read(plandir):
    manifest = gfm.read_manifest(plandir)
    assert sorted(manifest) == sorted(CPU_MODELS)
    for name in CPU_MODELS:
        plans, pack, entry = gfm.load_model_plans(plandir, name)  # each plan checked against its pack
        assert entry["check_errors"] == []
        assert set(plans) == ({"decode", "prefill8", "b8"} if name == "fam-llama" else {"decode", "prefill8"})
        assert plans["decode"].rows == 1 and plans["prefill8"].rows == 8
    q8 = gfm.load_model_plans(plandir, "gguf-q8_0-q8")[0]["decode"]
    assert q8.numerics == "q8" and any(c.format == "q8_0" for c in q8.constants.values())


@pytest.mark.slow
def test_pack_runs_as_transformers_does(plandir, tmp_path):
    """The batch family's saved decode plan on its pack (numpy, exact twins): transformers' 32 greedy tokens from
    the same saved weights, logits within 1e-4 of their scale; the chunk's last row likewise."""
    import torch
    import transformers

    from hf_ref import hf_greedy, scaled_error
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    gfm.build_family(gfm.BATCH_FAMILY, str(tmp_path / "m"))  # the same seed: the same weights
    stem = gfm.FAMILIES[gfm.BATCH_FAMILY][0]
    ref = getattr(transformers, f"{stem}ForCausalLM").from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    want, want_logits = hf_greedy(ref, gfm.PROMPT, gfm.N_TOKENS)
    plans, pack, _ = gfm.load_model_plans(plandir, f"fam-{gfm.BATCH_FAMILY}")
    got, got_logits = gfm.run_tokens(NumpyRunner(plans["decode"], pack), plans["decode"])
    assert got == want and len(set(want)) > 8
    assert scaled_error(got_logits, want_logits) < 1e-4
    with torch.no_grad():
        last = ref(torch.tensor([gfm.CHUNK])).logits[0, -1].numpy()
    chunk = gfm.run_chunk(NumpyRunner(plans["prefill8"], pack), plans["prefill8"])
    assert float(np.abs(chunk - last).max() / np.abs(last).max()) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_MODELS)
def test_the_gpu_model_test_on_a_stand_in_cupy(fake_cupy, plandir, name):
    """test_gpu_model's check, its CuPy runner over numpy-backed arrays with each launch's numpy twin: the loops,
    the graph capture and replays, the packs' upload — all but the kernels."""
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState

    plans, pack, _ = gfm.load_model_plans(plandir, name)
    line = gfm.check_model(plans, pack, lambda s, w: CupyRunner(s, w, DeviceState(), graph=True))
    assert line.startswith("32 of 32 tokens the same")


@pytest.mark.slow
def test_the_gpu_batch_test_on_a_stand_in_cupy(fake_cupy, plandir):
    plans, pack, entry = gfm.load_model_plans(plandir, f"fam-{gfm.BATCH_FAMILY}")
    line = gfm.check_batch(plans, pack, entry)
    assert "ending early" in line


def test_a_near_tie_ends_the_token_comparison_and_nothing_else_does():
    l = np.array([1.0, 2.0, 3.0], np.float32)
    tie = np.array([1.0, 3.0, 3.0 + 1e-6], np.float32)
    assert gfm.compare_tokens(([2, 1], [l, tie]), ([2, 2], [l, tie]), 1e-3, least=1) == (2, 0.0)
    with pytest.raises(AssertionError, match="token 0 against 2"):
        gfm.compare_tokens(([0], [l]), ([2], [l]), 1e-3, least=1)
    with pytest.raises(AssertionError, match="logits differ"):
        gfm.compare_tokens(([2], [l + 0.1]), ([2], [l]), 1e-3, least=1)


@pytest.mark.slow
def test_a_qwen3_next_plan_saved_loads(tmp_path):
    pytest.importorskip("egglog")
    pytest.importorskip("torch")
    from lanefuse.engine.front.load import load_model
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.lower.planfile import load, save

    gfm.build_family("qwen3_next", str(tmp_path / "m"))
    cfg, _ = load_model(tmp_path / "m")
    save(plan(build_step(cfg, 1)), str(tmp_path / "p.json"))
    load(str(tmp_path / "p.json"))


@pytest.mark.slow
def test_qwen3_next_under_a_cuda_graph_on_a_stand_in_cupy(fake_cupy, tmp_path):
    pytest.importorskip("egglog")
    pytest.importorskip("torch")
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState

    gfm.prepare(str(tmp_path), ["fam-qwen3_next"], log=lambda *a: None)
    plans, pack, _ = gfm.load_model_plans(str(tmp_path), "fam-qwen3_next")
    assert gfm.check_model(plans, pack, lambda s, w: CupyRunner(s, w, DeviceState(), graph=False))  # passes
    gfm.check_model(plans, pack, lambda s, w: CupyRunner(s, w, DeviceState(), graph=True))
