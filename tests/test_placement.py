"""Row placement and strided reads as step YAMLs: a row taken of a cache table that the step writes at that row
before the row's last reader is a copy (a free view where the table is not rewritten in between); keys and values
read as the two halves of one cache row reach the attention kernel's strides; a strided read no launch can take is
refused in words at plan time. Each plan runs in its arena against the reference interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import evaluate
from lanefuse.engine.placement import aliases, copied_views
from lanefuse.engine.front.stepweights import step_weights
from lanefuse.engine.stepyaml import from_yaml
from lanefuse.kernels import Attention, HostEnv
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.run.numpy_runner import NumpyRunner

HEAD = """meta: {model: placement, rows: 1}
weights: {random: 3}
io:
  token: token
  position: pos
  caches: [[kc1, vc1]]
  logits: logits
  next: next
tensors:
  token: i32[1]
  pos: i32[1]
  kc1: f32[16, 8]
  vc1: f32[16, 8]
constants:
  emb: {shape: [32, 8]}
  wk: {shape: [8, 8], transposed: true}
  wo: {shape: [32, 8], transposed: true}
ops:
"""

# row 4 of kc1 taken, kc1 written at row pos (4 in `lanefuse check`), then the row read: the row is copied when taken
VIEW_REWRITTEN = HEAD + """  - {op: gather, out: x, ins: [emb, token]}
  - {op: view, out: r, ins: [kc1], row: 4}
  - {op: matmul, out: k, ins: [x, wk]}
  - {op: set_row, out: kc, ins: [kc1, k, pos]}
  - {op: add, out: y, ins: [r, x]}
  - {op: matmul, out: logits, ins: [y, wo]}
  - {op: argmax, out: next, ins: [logits]}
"""

# the same, the row taken between the product and its row write: the placement that writes the product straight
# into the table's row must not come before the view
VIEW_BETWEEN = HEAD + """  - {op: gather, out: x, ins: [emb, token]}
  - {op: matmul, out: k, ins: [x, wk]}
  - {op: view, out: r, ins: [kc1], row: 4}
  - {op: set_row, out: kc, ins: [kc1, k, pos]}
  - {op: add, out: y, ins: [r, x]}
  - {op: matmul, out: logits, ins: [y, wo]}
  - {op: argmax, out: next, ins: [logits]}
"""

# the row's last reader comes before the table's row write: a free view
VIEW_FREE = HEAD + """  - {op: gather, out: x, ins: [emb, token]}
  - {op: view, out: r, ins: [kc1], row: 4}
  - {op: add, out: y, ins: [r, x]}
  - {op: matmul, out: k, ins: [y, wk]}
  - {op: set_row, out: kc, ins: [kc1, k, pos]}
  - {op: matmul, out: logits, ins: [y, wo]}
  - {op: argmax, out: next, ins: [logits]}
"""

# keys and values the two halves of every row of one cache table, written as one row by a merged product
KV_HALVES = """meta: {model: kv-halves, rows: 1}
weights: {random: 5}
io:
  token: token
  position: pos
  caches: [[kv1, spare]]
  logits: logits
  next: next
tensors:
  token: i32[1]
  pos: i32[1]
  kv1: f32[16, 16]
  spare: f32[16, 8]
constants:
  emb: {shape: [32, 8]}
  wq: {shape: [8, 8], transposed: true}
  wkv: {shape: [16, 8], transposed: true}
  wo: {shape: [32, 8], transposed: true}
ops:
  - {op: gather, out: x, ins: [emb, token]}
  - {op: matmul, out: q, ins: [x, wq]}
  - {op: matmul, out: kv, ins: [x, wkv]}
  - {op: set_row, out: kvc, ins: [kv1, kv, pos]}
  - {op: attention, out: a, ins: [q, kvc, kvc, pos], access: [null, [16, 0, 8], [16, 8, 8], null],
     heads: 2, kv_heads: 2, hd: 4, vd: 4, scale: 0.5}
  - {op: matmul, out: logits, ins: [a, wo]}
  - {op: argmax, out: next, ins: [logits]}
"""

# keys and values the two halves of every row of one cache table, each half written by a product of its own: a
# launch writes only part of the step's rows, and the check compares only what it wrote
KV_HALVES_TWO = KV_HALVES.replace("kv-halves", "kv-halves-two").replace(
    "  wkv: {shape: [16, 8], transposed: true}", "  wk: {shape: [8, 8], transposed: true}\n  wv: {shape: [8, 8], transposed: true}"
).replace("""  - {op: matmul, out: kv, ins: [x, wkv]}
  - {op: set_row, out: kvc, ins: [kv1, kv, pos]}
  - {op: attention, out: a, ins: [q, kvc, kvc, pos],""", """  - {op: matmul, out: k, ins: [x, wk], dst: {table: kv1, row: {param: pos}, unit: [16, 0, 8]}}
  - {op: matmul, out: v, ins: [x, wv], dst: {table: kv1, row: {param: pos}, unit: [16, 8, 8]}}
  - {op: attention, out: a, ins: [q, kv1, kv1, pos],""")

# a product of the second half of every row of x: no GEMV reads its activation strided
STRIDED_MATMUL = HEAD.replace("emb: {shape: [32, 8]}", "emb: {shape: [32, 16]}") + """  - {op: gather, out: x, ins: [emb, token]}
  - {op: matmul, out: logits, ins: [x, wo], access: [[16, 8, 8]]}
  - {op: argmax, out: next, ins: [logits]}
"""

# a norm of the second half of every row: the norm launch takes the part
STRIDED_NORM = HEAD.replace("emb: {shape: [32, 8]}", "emb: {shape: [32, 16]}\n  nw: {shape: [8], kind: values}") + """  - {op: gather, out: x, ins: [emb, token]}
  - {op: rmsnorm, out: n, ins: [x, nw], access: [[16, 8, 8]], eps: 1.0e-6}
  - {op: matmul, out: logits, ins: [n, wo]}
  - {op: argmax, out: next, ins: [logits]}
"""


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)


def _step(text: str, tmp_path, name: str = "step.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path, from_yaml(text, source=str(path))


def _against_reference(g, pos: int = 4):
    """The plan of `g` run in its arena and the reference interpreter on one step with a cache history: the logits,
    the next token and every cache table must agree."""
    w = step_weights(g)
    rng = np.random.default_rng(7)
    env = {n: np.zeros(g.tensors[n].shape, np.float32) for n in g.io.tables}
    for n in env:
        env[n][:8] = rng.standard_normal(env[n][:8].shape).astype(np.float32)
    env[g.io.token] = np.asarray([5], np.int32)
    env[g.io.position] = np.asarray([pos], np.int32)
    ref_env = {k: v.copy() for k, v in env.items()}
    ref = evaluate(g, w, ref_env)
    s = plan(g)
    out = NumpyRunner(s, w, check=True).step(env, lifted=g)
    np.testing.assert_allclose(out[g.io.logits], ref[g.io.logits], rtol=1e-5, atol=1e-6)
    assert int(out[g.io.next][0]) == int(np.asarray(ref[g.io.next]).reshape(-1)[0])
    for n in g.io.tables:
        np.testing.assert_allclose(env[n], ref_env[n], rtol=1e-5, atol=1e-6, err_msg=n)
    return s


@pytest.mark.parametrize("text", [VIEW_REWRITTEN, VIEW_BETWEEN], ids=["view-first", "view-between"])
def test_a_row_of_a_table_rewritten_before_its_last_reader_is_copied(text, tmp_path):
    path, g = _step(text, tmp_path)
    assert copied_views(g) == {"r"} and "r" not in aliases(g)
    s = _against_reference(g)
    assert s.census.get("slice") == 1
    assert s.buffers["r"].home == "r" and s.buffers["r"].where == "arena"  # its own buffer, not the table's row
    r = _cli("check", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-> ok" in r.stdout


def test_a_row_whose_table_is_not_rewritten_before_its_last_reader_stays_a_free_view(tmp_path):
    _, g = _step(VIEW_FREE, tmp_path)
    assert copied_views(g) == frozenset()
    s = _against_reference(g)
    assert "slice" not in s.census
    views = [x for x in s.launches if x.launch.census == "view"]
    assert len(views) == 1 and s.n_launches == len(s.launches) - 1  # the view runs no kernel
    b = s.buffers["r"]
    assert (b.home, b.offset, b.where) == ("kc1", 4 * 8, "table")


def test_keys_and_values_as_the_two_halves_of_one_cache_row(tmp_path):
    path, g = _step(KV_HALVES, tmp_path)
    s = _against_reference(g)
    (att,) = [x.launch for x in s.launches if x.launch.census == "attention"]
    assert (att.kstride, att.koff, att.vstride, att.voff) == (16, 0, 16, 8)
    r = _cli("check", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_check_compares_only_the_part_of_a_row_a_launch_writes(tmp_path):
    assert "unit: [16, 8, 8]" in KV_HALVES_TWO and "set_row" not in KV_HALVES_TWO
    path, g = _step(KV_HALVES_TWO, tmp_path)
    _against_reference(g)
    r = _cli("check", str(path))  # the key half's launch leaves the value half as it was: no false divergence
    assert r.returncode == 0 and "-> ok" in r.stdout, r.stdout + r.stderr


def test_a_strided_read_a_launch_honours_runs():
    g = from_yaml(STRIDED_NORM)
    s = _against_reference(g)
    (norm,) = [x.launch for x in s.launches if x.launch.census == "norm"]
    assert norm.part is not None and (norm.part.pitch, norm.part.offset, norm.part.width) == (16, 8, 8)


def test_a_strided_read_no_launch_takes_is_refused_in_words(tmp_path):
    path, g = _step(STRIDED_MATMUL, tmp_path)
    with pytest.raises(UserError, match=r"`matmul` -> `logits`: a strided read of `x` \(8 of every 16 values from "
                                        r"8\) that the gemv kernel cannot take"):
        plan(g)
    r = _cli("plan", str(path))
    assert r.returncode != 0 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "a strided read of `x`" in r.stderr and "gemv kernel cannot take" in r.stderr


def test_the_attention_numpy_twin_reads_keys_as_a_part_of_every_row():
    """kstride/koff, as vstride/voff: the keys read in place as the first half, the values the second."""
    g = np.random.default_rng(3)
    heads, kv, hd, vd, L, pos = 4, 2, 8, 8, 10, 6
    wide = g.standard_normal((L, kv * (hd + vd) + 3)).astype(np.float32)
    q = g.standard_normal((1, heads * hd)).astype(np.float32)
    pitch = wide.shape[1]
    env = HostEnv({"q": q, "kv": wide, "pos": np.array([pos], np.int32), "o": np.zeros(heads * vd, np.float32)})
    a = Attention("q", "kv", "kv", "pos", "o", heads, heads // kv, hd, vd, L, 1, 0.3, kstride=pitch, koff=3,
                  vstride=pitch, voff=3 + kv * hd)
    assert a.check() is None
    a.numpy(env)
    k = wide[: pos + 1, 3:3 + kv * hd].reshape(-1, kv, hd).astype(np.float64)
    v = wide[: pos + 1, 3 + kv * hd:].reshape(-1, kv, vd).astype(np.float64)
    want = np.zeros((heads, vd))
    for h in range(heads):
        s = k[:, h // (heads // kv)] @ q[0, h * hd:(h + 1) * hd] * 0.3
        e = np.exp(s - s.max())
        want[h] = e / e.sum() @ v[:, h // (heads // kv)]
    np.testing.assert_allclose(env.array("o").reshape(heads, vd), want, rtol=1e-5, atol=1e-6)


def _device() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _device(), reason="no CUDA device")
@pytest.mark.parametrize("splits", [1, 3])
def test_the_attention_kernel_reads_keys_and_values_as_parts_of_one_row(splits):
    from lanefuse.kernels.cupy_env import DeviceEnv

    g = np.random.default_rng(5)
    heads, kv, hd, vd, L, pos = 8, 2, 64, 32, 300, 257
    pitch = kv * (hd + vd) + 5
    arrays = {"q": g.standard_normal(heads * hd).astype(np.float32),
              "kv": g.standard_normal(L * pitch).astype(np.float32), "pos": np.array([pos], np.int32),
              "o": np.zeros(heads * vd, np.float32)}
    a = Attention("q", "kv", "kv", "pos", "o", heads, heads // kv, hd, vd, L, 1, hd ** -0.5, splits=splits,
                  kstride=pitch, koff=5, vstride=pitch, voff=5 + kv * hd)
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, {})
    a.numpy(host)
    dev = DeviceEnv(0, {}, arrays, {})
    a.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    np.testing.assert_allclose(dev.host("o"), host.array("o"), rtol=2e-4, atol=2e-4)


def test_a_view_of_a_copied_row_is_free_and_a_row_taken_after_the_write_is_free():
    """A view of the copy reads the copy; a row taken of the table after its write reads the table as written."""
    text = HEAD + """  - {op: gather, out: x, ins: [emb, token]}
  - {op: view, out: r, ins: [kc1], row: 4}
  - {op: view, out: r2, ins: [r], row: 0}
  - {op: matmul, out: k, ins: [x, wk]}
  - {op: set_row, out: kc, ins: [kc1, k, pos]}
  - {op: add, out: y, ins: [r2, x]}
  - {op: view, out: r3, ins: [kc], row: 4}
  - {op: add, out: y2, ins: [y, r3]}
  - {op: matmul, out: logits, ins: [y2, wo]}
  - {op: argmax, out: next, ins: [logits]}
"""
    g = from_yaml(text)
    assert copied_views(g) == {"r"}
    assert aliases(g) == {"r2": ("r", 0), "kc": ("kc1", 0), "r3": ("kc", 32)}
    assert _against_reference(g).census.get("slice") == 1
