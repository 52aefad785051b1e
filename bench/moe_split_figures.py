"""Moe `router_split`'s figures (issue 40 item 4): bench/launch_model.py's PREDICTION of the decode step of a
Qwen3-30B-A3B-shaped and a gpt-oss-120b-shaped bf16 plan (bench/moe_figures.py's shapes, no weights) with the
schedule step on and held: each mixture's up kernel (moe_up_split / moe_up: its grid, ptxas's registers and blocks a
SM, the rounds on a block's path, its µs) and the whole token. No device has run a mixture's kernels at these shapes:
every figure is a prediction of a model calibrated on the 2026-12-04 H200 figures of the dense GEMV kernels.

    python bench/moe_split_figures.py [--pos 512] [--layers N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import launch_model as lm  # noqa: E402
from moe_figures import gptoss_120b, qwen3_30b_a3b  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pos", type=int, default=512)
    ap.add_argument("--layers", type=int, default=0, help="layers of each shape (default: the model's own)")
    a = ap.parse_args()
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    cal = lm.load_calibration()
    print(f"PREDICTIONS (bench/launch_model.py, no device), decode at position {a.pos}, bf16 rows")
    for name, cfg in (("Qwen3-30B-A3B", qwen3_30b_a3b(a.layers or 48)), ("gpt-oss-120b", gptoss_120b(a.layers or 36))):
        g = build_step(cfg, 1)
        token = {}
        for held in ((), ("router_split",)):
            s = plan(g, held=list(held))
            ks = lm.model(s, None, cal, a.pos)
            ups = [k for k in ks if k.call.name.startswith("moe_up")]
            token[held] = sum(k.us for k in ks)
            u = ups[0]
            print(f"{name} ({'router_split held' if held else 'router_split on'}): {len(s.launches)} launches, "
                  f"{len(ks)} kernels; {u.call.name} grid {u.call.grid}, {u.regs} registers, {u.bpsm} blocks a SM, "
                  f"router_split {u.launch.router_split}, a block's rounds {u.rounds:.0f} (router "
                  f"{u.extra['router_rounds']}, gate/up {u.extra['glu_rounds']}), tail {u.tail:.2f} us: "
                  f"{u.us:.1f} us a layer, {len(ups)} layers {sum(k.us for k in ups):.0f} us; "
                  f"token {token[held]:.0f} us")
        print(f"{name}: token {token[('router_split',)]:.0f} -> {token[()]:.0f} us (held -> on), "
              f"{token[('router_split',)] - token[()]:.0f} us less")


if __name__ == "__main__":
    main()
