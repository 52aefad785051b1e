"""GPU decode benchmark: time per token and tokens/s of saved decode plans on the device, CUDA graph on and off,
against the HBM roofline (the bytes a token must read — weights and the KV cache — over the chip's bandwidth), with
launches per step. Plans come from bench/gpu_prepare.py (no solver needed here).

    python bench/gpu_decode.py --plans PLANDIR [--pos 512] [--iters 100] [--rounds 5] [--json FILE]

(the median of `--rounds` rounds of `--iters` steps each, a figure; bench/gpu_suite.sh runs fewer of both to fit
its time)

Beside each plan's graph figure, the same graph with programmatic dependent launch (LANEFUSE_PDL=1, kernels/pdl.py:
every kernel may start while the one before it drains, the GEMVs prefetching their first weights into L2); and for
the bf16 Qwen3-8B plan a per-kind breakdown (each launch timed alone between CUDA events, no graph, summed by its
census kind) beside the lane's own estimate (the plan's cost_us a launch, lane/lower/shim.py) and
bench/launch_model.py's prediction (PLANDIR/launch-model.json, written on the CPU by `bench/gpu_suite.sh prepare`):
issue 34 items 5 and 7.

Then the batch figure (issue 16): the Qwen3-8B-shaped decode step of B = 1..64 sequences (qwen3-8b-decode-bB.json,
each sequence at `--pos`), time a step and the aggregate tokens/s (B tokens a step); skipped where the plans are
absent. Nothing here runs without a CUDA device (CuPy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np

SPEC_TBPS = 4.8  # H200 HBM3e, the datasheet's figure


def block_weights(c, rng):
    """Random blocks of `c`'s block format made on the device: random value bytes, every f16 scale one finite value
    (about 1/sqrt(cols) a value), so the step's numbers stay finite."""
    import cupy as cp

    from lanefuse.engine.formats.blocks import BLOCKS

    vb, bb = BLOCKS[c.format]
    raw = rng.integers(0, 256, size=(c.size // vb, bb), dtype=cp.int32).astype(cp.uint8)
    d = np.frombuffer(np.float16(1.0 / np.sqrt(c.shape[-1]) / 8).tobytes(), np.uint8)
    for o in {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}[c.format]:
        raw[:, o], raw[:, o + 1] = int(d[0]), int(d[1])
    return raw.reshape(-1)


def device_weights(s, seed: int = 0):
    """Random weights made on the device for every constant of the plan (bf16/f16 rows as their bits, block formats
    as random blocks)."""
    import cupy as cp

    from lanefuse.engine.formats.blocks import BLOCKS

    rng = cp.random.default_rng(seed)
    out = {}
    for name, c in s.constants.items():
        n = c.size
        if c.kind == "values":
            v = (1.0 + 0.01 * rng.standard_normal(n, dtype=cp.float32)).astype(cp.float32)
            out[name] = (v, "f32")
            continue
        if c.format in BLOCKS:
            out[name] = (block_weights(c, rng), c.format)
            continue
        scale = 1.0 / np.sqrt(c.shape[-1])
        v = rng.standard_normal(n, dtype=cp.float32) * cp.float32(scale)
        if c.format == "bf16":
            out[name] = ((v.view(cp.uint32) >> 16).astype(cp.uint16), "bf16")
        elif c.format == "f16":
            out[name] = (v.astype(cp.float16), "f16")
        else:
            out[name] = (v, "f32")
        del v
    return out


def _flat(l):
    return _flat(l.first) + _flat(l.then) if l.census == "fold" else [l]


def token_bytes(s, pos: int) -> int:
    """What one decode token must read from HBM: every weight it multiplies (a gathered table: one row), and the
    KV cache up to the position."""
    from lanefuse.kernels.common import weight_bytes

    multiplied = {n for x in s.launches for l in _flat(x.launch) if l.census != "gather" for n in l.reads()}
    total = 0
    for c in s.constants.values():
        if c.source.startswith("rope."):
            continue  # one row of each table
        fmt = c.format if c.kind == "rows" else "f32"
        rows = c.size // c.shape[-1] if c.name in multiplied else 1
        total += weight_bytes(fmt, rows, c.shape[-1])  # the quantized bytes of a block format
    for k, _ in s.io.caches:
        total += 2 * (pos + 1) * s.tensors[k].shape[-1] * 4
    return total


def copy_bandwidth() -> float:
    """A device-to-device copy's bandwidth in TB/s (read + write), for a second roofline."""
    import cupy as cp

    a = cp.empty(1 << 30, dtype=cp.uint8)
    b = cp.empty_like(a)
    for _ in range(3):
        b[:] = a
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(20):
        b[:] = a
    e1.record()
    e1.synchronize()
    ms = cp.cuda.get_elapsed_time(e0, e1) / 20
    return 2 * a.nbytes / (ms * 1e-3) / 1e12


def runner(s, weights_state, graph: bool, pdl: bool = False):
    """A CupyRunner of plan `s`, its kernels launched with programmatic dependent launch (where the device has it:
    sm_90+) or not, whatever LANEFUSE_PDL says."""
    from lanefuse.lane.run.cupy_runner import CupyRunner

    r = CupyRunner(s, None, weights_state, graph=graph)
    r.env.pdl = pdl and r.env.pdl_able
    return r


def time_plan(s, weights_state, pos: int, iters: int, graph: bool, rounds: int = 5, pdl: bool = False) -> float:
    """Median microseconds a decode step takes at `pos`, over `rounds` rounds of `iters` replays (CUDA events)."""
    import cupy as cp

    r = runner(s, weights_state, graph, pdl)
    r.state.loaded = True
    b = s.batch  # a batch step: every sequence at `pos` (its own slot)
    inputs = {s.io.token: np.ones(b, np.int32), s.io.position: np.full(b, pos, np.int32)}
    r.load_inputs(inputs)
    r._replay()  # compiles, captures
    times = []
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(rounds):
        r.load_inputs(inputs)
        e0.record(r._stream)
        for _ in range(iters):
            if graph:
                r._graph.launch(stream=r._stream)
            else:
                with r._stream:
                    r.run_launches()
            # the arg-max advanced the position: keep timing at `pos`
        e1.record(r._stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / iters)
    return statistics.median(times)


def launch_times(s, r, inputs) -> list[tuple[int, float]]:
    """(plan launch index, µs) of each launch of plan `s` that runs a kernel, one step of runner `r` with `inputs`
    loaded, each launch alone between CUDA events on the runner's stream (no graph)."""
    import cupy as cp

    r.load_inputs(inputs)
    idx = [i for i, x in enumerate(s.launches) if x.launch.kernels()]
    ev = [cp.cuda.Event() for _ in range(len(idx) + 1)]
    with r._stream:
        ev[0].record(r._stream)
        for j, i in enumerate(idx):
            s.launches[i].launch.cuda(r.env)
            ev[j + 1].record(r._stream)
    ev[-1].synchronize()
    return [(i, cp.cuda.get_elapsed_time(ev[j], ev[j + 1]) * 1e3) for j, i in enumerate(idx)]


def per_kind(s, weights_state, pos: int, rounds: int = 5) -> list[dict]:
    """Each launch of plan `s` timed alone (CUDA events around it, no graph; the median of `rounds` steps), summed by
    its census kind: measured µs beside the lane's estimate (cost_us) and the launch model's prediction."""
    import collections

    r = runner(s, weights_state, graph=False)
    r.state.loaded = True
    inputs = {s.io.token: np.ones(s.batch, np.int32), s.io.position: np.full(s.batch, pos, np.int32)}
    r.load_inputs(inputs)
    r._replay()
    per = collections.defaultdict(list)
    for _ in range(rounds):
        for i, us in launch_times(s, r, inputs):
            per[i].append(us)
    idx = sorted(per)
    return [{"index": i, "kind": s.launches[i].launch.census, "us": statistics.median(per[i]),
             "lane_us": float(getattr(s.launches[i], "cost_us", 0.0))} for i in idx]


def print_kinds(rows: list[dict], predicted: dict | None) -> list[dict]:
    """Per census kind: launches, measured µs, the lane's estimate and the launch model's prediction, with their
    ratios to the measurement (issue 34 item 5: within ±25% is the goal)."""
    kinds: dict[str, dict] = {}
    for x in rows:
        k = kinds.setdefault(x["kind"], {"kind": x["kind"], "launches": 0, "us": 0.0, "lane_us": 0.0,
                                         "model_us": 0.0 if predicted else None})
        k["launches"] += 1
        k["us"] += x["us"]
        k["lane_us"] += x["lane_us"]
        if predicted:
            k["model_us"] += predicted.get(str(x["index"]), 0.0)
    total = sum(k["us"] for k in kinds.values())
    print(f"  per kind (each launch alone, no graph; sum {total:.0f} µs): measured · lane estimate · launch model "
          f"(PREDICTION)")
    out = []
    for k in sorted(kinds.values(), key=lambda k: -k["us"]):
        m = f"{k['model_us']:9.0f} µs ({k['model_us'] / k['us']:5.2f}x)" if k["model_us"] is not None else "      –"
        print(f"    {k['kind']:18s} {k['launches']:4d} launches {k['us']:9.0f} µs ({k['us'] / total:5.1%}) · lane "
              f"{k['lane_us']:9.0f} µs ({k['lane_us'] / k['us']:5.2f}x) · model {m}")
        out.append({x: (round(v, 2) if isinstance(v, float) else v) for x, v in k.items()})
    return out


def main() -> None:
    from lanefuse.engine import flags

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default=flags.read("LANEFUSE_PLANS") or "plans")
    ap.add_argument("--pos", type=int, default=512)
    ap.add_argument("--iters", type=int, default=100, help="steps timed a round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds a figure (their median)")
    ap.add_argument("--json")
    args = ap.parse_args()
    from lanefuse.lane.lower.planfile import load
    from lanefuse.lane.run.cupy_runner import DeviceState

    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw:.2f} TB/s (spec {SPEC_TBPS} TB/s)")
    results = []
    predicted = {}
    if os.path.exists(os.path.join(args.plans, "launch-model.json")):
        with open(os.path.join(args.plans, "launch-model.json")) as f:
            predicted = json.load(f).get("plans", {})
    for name in ("demo-decode", "qwen3-8b-decode", "qwen3-8b-q8_0-decode", "qwen3-8b-q4_0-decode",
                 "qwen3-8b-q4_k-decode", "qwen3-8b-q6_k-decode"):
        path = os.path.join(args.plans, name + ".json")
        if not os.path.exists(path):
            print(f"{name}: no plan at {path} (run bench/gpu_suite.sh prepare)")
            continue
        s = load(path)
        pos = min(args.pos, s.tensors[s.io.caches[0][0]].shape[0] - args.iters * 0 - 2)
        state = DeviceState()
        state.weights.update(device_weights(s))
        nbytes = token_bytes(s, pos)
        row = {"plan": name, "launches": s.n_launches, "token_bytes": nbytes, "pos": pos}
        for graph, pdl in ((True, False), (True, True), (False, False)):
            try:
                us = time_plan(s, state, pos, args.iters, graph, args.rounds, pdl)
            except Exception as e:  # noqa: BLE001 (PDL never ran on a device before: its failure is a figure too)
                print(f"{name:16s} graph {'on ' if graph else 'off'}{' + PDL' if pdl else ''}: failed: "
                      f"{type(e).__name__}: {e}")
                row["graph_pdl" if pdl else "graph" if graph else "no_graph"] = {"error": f"{type(e).__name__}: {e}"}
                continue
            roof_spec = nbytes / (SPEC_TBPS * 1e12) * 1e6
            roof_copy = nbytes / (bw * 1e12) * 1e6
            key = "graph_pdl" if pdl else "graph" if graph else "no_graph"
            row[key] = {"us_per_token": round(us, 2), "tokens_per_s": round(1e6 / us, 1),
                        "roofline_us_spec": round(roof_spec, 2), "ratio_spec": round(roof_spec / us, 3),
                        "ratio_copy": round(roof_copy / us, 3)}
            print(f"{name:16s} graph {'on ' if graph else 'off'}{' + PDL' if pdl else ''}: {us:9.1f} µs/token {1e6 / us:9.1f} tok/s · "
                  f"{nbytes / 1e9:.3f} GB a token · roofline {roof_spec:.1f} µs → {roof_spec / us:.1%} of spec HBM, "
                  f"{roof_copy / us:.1%} of copy bandwidth · {s.n_launches} launches")
        model = predicted.get(name, {})
        if model:
            row["launch_model_us"] = model.get("us")
            print(f"{name:16s} launch model (PREDICTION): {model.get('us', 0):9.1f} µs/token")
        if name == "qwen3-8b-decode":
            row["kinds"] = print_kinds(per_kind(s, state, pos, args.rounds), model.get("launches"))
        results.append(row)
    batches = batch_figure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tbps": bw, "results": results, "batches": batches}, f, indent=1)


BATCHES = (1, 2, 4, 8, 16, 32, 64)  # the batch plans bench/gpu_prepare.py saves


def batch_figure(args) -> list[dict]:
    """The Qwen3-8B-shaped decode step of B sequences: µs a step (CUDA graph) and the aggregate tokens/s."""
    from lanefuse.lane.lower.planfile import load
    from lanefuse.lane.run.cupy_runner import DeviceState

    rows, state = [], None
    for b in BATCHES:
        path = os.path.join(args.plans, f"qwen3-8b-decode-b{b}.json")
        if not os.path.exists(path):
            print(f"batch {b}: no plan at {path} (run bench/gpu_suite.sh prepare)")
            continue
        s = load(path)
        if state is None:  # the weights once for every B (each plan's caches its own: B slots)
            state = DeviceState()
            state.weights.update(device_weights(s))
        state.tables.clear()
        slot = s.tensors[s.io.caches[0][0]].shape[0] // b
        pos = min(args.pos, slot - 2)
        us = time_plan(s, state, pos, args.iters, True, args.rounds)
        rows.append({"batch": b, "launches": s.n_launches, "us_per_step": round(us, 2),
                     "tokens_per_s": round(b * 1e6 / us, 1)})
        print(f"qwen3-8b batch {b:>2}: {us:9.1f} µs a step · {b * 1e6 / us:9.1f} tokens/s over the batch · "
              f"{s.n_launches} launches")
    return rows


if __name__ == "__main__":
    main()
