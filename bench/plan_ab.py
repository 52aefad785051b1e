"""plan() of this tree against another lanefuse checkout (an older commit's `git worktree`), side by side in one run:
two worker processes, one importing each tree, plan the same step graphs in turn, alternating run by run, so machine
load falls on both alike; each run's plan is digested (every launch's fields, the arena, the census, the fusions) and
the two trees' digests must be equal (a speed-up that changes a plan is a defect).

    python bench/plan_ab.py --against /path/to/old/checkout [--runs 5] [--numerics f32 q8] [--shapes deepseek-v3 ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = ("qwen3-next-80b-a3b", "qwen3-8b", "deepseek-v3", "demo")  # demo: the seeded demo model (`lanefuse demo`)


def worker() -> int:
    """Read `shape numerics` lines; plan each and print its seconds and digest, a JSON line each."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from deepseek_figures import deepseek_v3
    from qnext_figures import qwen3_8b, qwen3_next_80b_a3b  # this bench folder's shapes, whichever tree is imported

    import dataclasses

    from lanefuse.engine.front.demo import demo_config
    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.rules import load_table
    from lanefuse.lane.lower.plan import plan

    table = load_table()
    graphs = {}
    for line in sys.stdin:
        shape, numerics = line.split()
        if (shape, numerics) not in graphs:
            cfg = {"qwen3-next-80b-a3b": lambda: qwen3_next_80b_a3b(4096), "qwen3-8b": lambda: qwen3_8b(4096),
                   "deepseek-v3": deepseek_v3, "demo": demo_config}[shape]()
            if numerics != "f32":
                cfg = dataclasses.replace(cfg, formats=tuple((n, "q8_0") for n, _ in cfg.formats))
            graphs[shape, numerics] = build_step(cfg, 1)
        t0 = time.perf_counter()
        s = plan(graphs[shape, numerics], table=table, numerics=numerics)
        sec = time.perf_counter() - t0
        text = "\n".join([repr(x.launch) for x in s.launches] + [repr(s.arena), repr(sorted(s.census.items())),
                                                                 repr(sorted(s.fusions.items()))])
        text = text.replace(", absorb=None", "")  # a field with its default that older trees' launches lack
        print(json.dumps({"s": sec, "digest": hashlib.sha256(text.encode()).hexdigest()[:16],
                          "launches": s.n_launches}), flush=True)
    return 0


def start(tree: Path | None) -> subprocess.Popen:
    env = dict(os.environ)
    if tree is not None:  # the other checkout's folders as the lanefuse package, ahead of this tree's install
        pkg = Path("/tmp") / f"lanefuse-ab-{os.getpid()}" / "lanefuse"
        pkg.mkdir(parents=True, exist_ok=True)
        for d in ("engine", "lane", "kernels", "rules"):
            link = pkg / d
            if link.is_symlink():
                link.unlink()
            link.symlink_to(tree.resolve() / d)
        env["PYTHONPATH"] = str(pkg.parent) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)


def ask(p: subprocess.Popen, shape: str, numerics: str) -> dict:
    p.stdin.write(f"{shape} {numerics}\n")
    p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        raise SystemExit(f"a worker stopped (exit {p.wait()})")
    return json.loads(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, help="the other lanefuse checkout (its engine/, lane/, kernels/, rules/)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--numerics", nargs="+", default=["f32"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES[:2]), choices=SHAPES)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker()
    if args.against is None or not (args.against / "engine").is_dir():
        raise SystemExit("--against: a lanefuse checkout (a folder holding engine/, lane/, kernels/, rules/)")
    new, old = start(None), start(args.against)
    bad = 0
    for numerics in args.numerics:
        for shape in args.shapes:
            times = {"this": [], "other": []}
            digests = set()
            for k in range(args.runs + 1):  # the first run of each warms both (imports, caches): not counted
                order = (("this", new), ("other", old)) if k % 2 else (("other", old), ("this", new))
                got = {}
                for who, p in order:
                    got[who] = ask(p, shape, numerics)
                    if k:
                        times[who].append(got[who]["s"])
                if got["this"]["digest"] != got["other"]["digest"]:
                    digests.add((got["this"]["digest"], got["other"]["digest"]))
            a, b = times["this"], times["other"]
            same = "same plan" if not digests else f"PLANS DIFFER {sorted(digests)}"
            bad += bool(digests)
            print(f"{shape:18s} {numerics:4s} this tree {statistics.median(a):.3f} s ({min(a):.3f}-{max(a):.3f}), "
                  f"other {statistics.median(b):.3f} s ({min(b):.3f}-{max(b):.3f}), ratio "
                  f"{statistics.median(a) / statistics.median(b):.2f}; {got['this']['launches']} launches; {same}")
    for p in (new, old):
        p.stdin.close()
        p.wait()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
