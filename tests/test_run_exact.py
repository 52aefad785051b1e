"""`lanefuse run --exact`: the numpy backend's exact twins in place of the fast ones. Under --numerics q8 they are
llama.cpp's CPU arithmetic (engine/formats/ggml.py, issue 41), so their logits are the reference interpreter's to the
bit, where the fast twins (f32 BLAS on decoded rows) differ by an activation's rounding flip; under q8 on the CPU they
are the default (`--fast-twins`: the fast ones). Each flag refused in one line where it cannot apply (with
--reference, with each other, or on a device)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lanefuse.lane.cli.main import main

RUN = ("run", "--prompt-ids", "5,6,7", "--tokens", "4", "--weights-format", "q4_k", "--numerics", "q8")


def _logits(tmp_path, capsys, *extra):
    out = tmp_path / f"o{len(list(tmp_path.iterdir()))}.json"
    assert main([*RUN, *extra, "--json", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())
    return doc["generated_ids"], np.array(doc["logits"], dtype=np.float64)


def test_exact_twins_under_q8_are_the_reference_to_the_bit(tmp_path, capsys):
    ids_x, exact = _logits(tmp_path, capsys, "--exact", "--device", "cpu")
    ids_r, ref = _logits(tmp_path, capsys, "--reference")
    ids_d, default = _logits(tmp_path, capsys, "--device", "cpu")
    ids_f, fast = _logits(tmp_path, capsys, "--device", "cpu", "--fast-twins")
    assert ids_x == ids_r and np.array_equal(exact, ref)
    assert ids_d == ids_r and np.array_equal(default, ref)  # q8 on the CPU: the exact twins unless told otherwise
    assert ids_f == ids_r and np.abs(fast - ref).max() < 0.5  # the fast twins: near, not equal (a flip or two)
    assert not np.array_equal(fast, ref)


def test_the_run_says_which_twins(capsys):
    """The model line names the twins a q8 run on the CPU takes: the exact ones by default, not with --fast-twins."""
    for extra, label in (((), "numpy backend, exact twins"), (("--fast-twins",), "numpy backend;")):
        assert main([*RUN, "--device", "cpu", "--tokens", "1", *extra]) == 0
        err = capsys.readouterr().err
        assert label in next(line for line in err.splitlines() if "model:" in line), err


@pytest.mark.parametrize("extra, says", [
    (("--exact", "--reference"), "lanefuse: error: --exact and --reference: the exact twins run a fused plan, the "
                                 "reference the lifted graph; give one"),
    (("--exact", "--device", "gpu"), "lanefuse: error: --device gpu: no CUDA device (or CuPy) is available here"),
    (("--fast-twins", "--exact"), "lanefuse: error: --fast-twins and --exact: the fast twins run a fused plan's "
                                  "launches by f32 BLAS, the exact twins as each kernel sums; give one"),
    (("--fast-twins", "--reference"), "lanefuse: error: --fast-twins and --reference: the fast twins run a fused "
                                      "plan's launches by f32 BLAS, the reference the lifted graph; give one"),
])
def test_exact_and_fast_twins_are_refused_in_one_line_where_they_cannot_apply(extra, says, capsys):
    import lanefuse.lane.run.step as step

    if extra[-1] == "gpu" and step.pick_device("auto") == "gpu":
        pytest.skip("a device is present: --device gpu is valid here, and --exact refused for it (the next line)")
    assert main([*RUN, *extra]) != 0
    err = capsys.readouterr().err.strip().splitlines()  # (the KV cache's size said first, as every run says it)
    assert [line for line in err if "error" in line] == err[-1:] and err[-1].startswith(says), err
