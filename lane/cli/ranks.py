"""`--ranks R` on plan, run and check: each rank's share of the model (engine/front/parallel.py) and what it costs, R
processes' run (lane/run/ranks.py), and R ranks' step checked against one rank's."""

from __future__ import annotations

import json
import math
import sys

from lanefuse.engine.errors import UserError


def _cfg(src, ranks: int, what: str):
    from lanefuse.engine.front.parallel import check_ranks

    if src.cfg is None:
        raise UserError(f"{what} --ranks {ranks}: {src.name} is one step YAML; --ranks splits a model (a checkpoint "
                        f"folder, a config-only folder, a GGUF file or the demo)")
    check_ranks(src.cfg, ranks)
    return src.cfg


def rank_report(cfg, ranks: int, rows: int, knobs, batch: int = 1) -> dict:
    """Each rank's share (heads, KV heads, FFN, experts and vocabulary parts, weight and KV-cache bytes, whether they
    fit a device of knob device_gb) and the collectives of its step of `rows` rows (`batch` > 1: the decode step of
    that many sequences, their caches a slot each), each priced on the lane's link (PREDICTIONS:
    lane/lower/collectives.py)."""
    from lanefuse.engine.front.parallel import build_rank_step, part, rank_config, rank_weight_bytes
    from lanefuse.lane.lower.collectives import collective_us, payload_bytes

    weights = rank_weight_bytes(cfg, ranks)
    out = {"model": cfg.name, "ranks": ranks, "rows": rows, "batch": batch, "device_gb": knobs.device_gb, "rank": []}
    for r in range(ranks):
        rc = rank_config(cfg, r, ranks)
        caches = 4 * batch * sum(math.prod(s) for s in rc.carried().values())
        lo, hi = part(cfg.vocab, ranks, r) if ranks > 1 else (0, cfg.vocab)
        need = weights[r] + caches
        m = rc.moe if rc.moe is not None and rc.moe.sparse else None
        experts = [m.lo, m.lo + m.held] if m is not None else None
        dense = any(not cfg.sparse(i) for i in range(cfg.layers))  # no dense FFN: no part of one (None)
        out["rank"].append({"rank": r, "heads": rc.heads, "kv_heads": rc.kv_heads, "ffn": rc.inter if dense else None,
                            "experts": experts, "vocab": [lo, hi], "weight_bytes": weights[r],
                            "kv_cache_bytes": caches, "fits": need <= knobs.device_gb * 1e9})
    g = build_rank_step(cfg, 0, ranks, rows, batch)
    coll: dict[str, dict] = {}
    for op in g.ops:
        if op.kind in ("all_reduce", "all_gather", "all_argmax"):
            b = payload_bytes(op.kind, g.shape(op.ins[0]), ranks)
            c = coll.setdefault(op.kind, {"count": 0, "bytes": 0, "us": 0.0})
            c["count"] += 1
            c["bytes"] += b
            c["us"] += collective_us(op.kind, b, ranks, knobs)
    out["collectives"] = coll
    out["link"] = {"gbps": knobs.link_gbps, "us": knobs.link_us}
    return out


def plan_ranks(args, src, rows: int) -> int:
    """`lanefuse plan --ranks R`: the table of each rank's share and the collectives of its step."""
    from lanefuse.lane.cli.options import plan_options

    cfg = _cfg(src, args.ranks, "plan")
    batch = getattr(args, "batch", 1) or 1
    rep = rank_report(cfg, args.ranks, rows, plan_options(args).knobs, batch)
    if args.json:
        from lanefuse.lane.lower.files import write_atomic

        write_atomic(args.json, json.dumps(rep, indent=1) + "\n")  # the ranks' report (rank 0's plan: without --ranks
        return 0  # on a rank's step YAML)
    moe = rep["rank"][0]["experts"] is not None
    print(f"{cfg.name} over {args.ranks} ranks (tensor parallel: heads, KV heads and their caches, the FFN and the "
          f"vocabulary split; " + ("expert parallel: each rank its experts, the router whole; " if moe else "") +
          "the embedding and norms whole on each)")
    print(f"{'rank':>4} {'heads':>5} {'kv':>3} {'ffn':>7} " + (f"{'experts':>11} " if moe else "") +
          f"{'vocabulary':>17} {'weights':>10} {'KV cache':>10}  fits {knobs_gb(rep)}")
    for r in rep["rank"]:
        lo, hi = r["vocab"]
        ex = f"{r['experts'][0]}..{r['experts'][1] - 1}" if moe else ""
        ffn = "-" if r["ffn"] is None else r["ffn"]
        print(f"{r['rank']:>4} {r['heads']:>5} {r['kv_heads']:>3} {ffn:>7} " + (f"{ex:>11} " if moe else "") +
              f"{f'{lo}..{hi - 1}':>17} {_size(r['weight_bytes']):>10} {_size(r['kv_cache_bytes']):>10}  "
              f"{'yes' if r['fits'] else 'NO'}")
    total = sum(c["us"] for c in rep["collectives"].values())
    what = f"batch step of {batch}" if batch > 1 else "decode step" if rows == 1 else f"{rows}-row chunk"
    parts = ", ".join(f"{c['count']} {k} ({c['bytes'] / c['count']:,.0f} B a rank each)"
                      for k, c in rep["collectives"].items())
    print(f"collectives a {what}: {parts or 'none'}; {total:.1f} us a step on the link (a PREDICTION at "
          f"{rep['link']['gbps']:g} GB/s and {rep['link']['us']:g} us each: knobs link_gbps, link_us)")
    from lanefuse.engine.front.parallel import build_rank_step
    from lanefuse.lane.cli.report import plan_command

    print("rank 0's step (every rank's has its launches; the parts' shapes differ where the FFN or vocabulary "
          "does not split evenly):")
    sys.stdout.flush()
    return plan_command(args, src, build_rank_step(cfg, 0, args.ranks, rows, batch))


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def knobs_gb(rep: dict) -> str:
    return f"({rep['device_gb']:g} GB: knob device_gb)"


def _run_checks(args, src, sampling, batch: bool) -> None:
    """What `run --ranks R` refuses, in one line each: a model not in a file, sampling, a saved plan."""
    R = args.ranks
    _cfg(src, R, "run")
    if src.path is None:
        raise UserError(f"run --ranks {R}: each rank process reads the model from its file; give a checkpoint "
                        f"folder or a .gguf file (the demo model lives in memory)")
    if sampling is not None and not sampling.greedy:
        raise UserError(f"run --ranks {R}: ranks decode greedily (their arg-max meets across them); drop --temp")
    for flag in ("plan",) if batch else ("plan", "batch", "prompts"):
        if getattr(args, flag, None):
            raise UserError(f"run --ranks {R}: --{flag} is one rank's (not split over ranks yet)")


def run_ranks(args, src, ids: list[int], sampling) -> int:
    """`lanefuse run --ranks R`: R processes of this machine (gloo), each its rank's steps; rank 0's tokens."""
    import time

    from lanefuse.lane.run.ranks import launch

    R = args.ranks
    _run_checks(args, src, sampling, False)
    how = "the reference interpreter" if args.reference else "its plan for the cuda lane on the numpy backend"
    print(f"lanefuse: model: {src.name} ({R} ranks over gloo, each {how}; greedy)", file=sys.stderr)
    t0 = time.perf_counter()
    res = launch(R, [dict(model=src.path, prompt=list(ids), n_tokens=args.tokens, chunk=min(len(ids), 512),
                          max_len=src.cfg.max_len, plan=not args.reference)])[0]
    dt = time.perf_counter() - t0
    toks = res[0]["tokens"]
    out = {"model": src.name, "ranks": R, "prompt_ids": list(ids), "generated_ids": [int(t) for t in toks]}
    human = sys.stderr if args.json == "-" else sys.stdout
    print("prompt ids:   ", ",".join(map(str, ids)), file=human)
    print("generated ids:", ",".join(map(str, out["generated_ids"])), file=human)
    print(f"lanefuse: {R} ranks: {dt:.2f} s (process start-up included); {res[0]['calls']} collectives a rank, "
          f"{res[0]['bytes']:,} B sent a rank", file=sys.stderr)
    if args.json:
        from lanefuse.lane.lower.files import write_atomic

        write_atomic(args.json, json.dumps(out) + "\n")
    return 0


def run_ranks_batch(args, src, sampling) -> int:
    """`lanefuse run --ranks R` of a batch (several --prompt-ids, --prompts FILE or --batch N): R processes of this
    machine (gloo), each its rank's batch steps (lane/run/ranks.rank_generate with the prompts: each prompt prefilled
    alone into its slot of the rank's caches, then decoded with the others); a line a prompt, as one rank's batch
    prints (rank 0's tokens: every rank's are the same)."""
    import time

    from lanefuse.lane.cli.prompts import _batch_prompts, batch_slots, print_prompt_lines
    from lanefuse.lane.run.batch import check_prompts
    from lanefuse.lane.run.ranks import launch

    R = args.ranks
    _run_checks(args, src, sampling, True)
    prompts, tok = _batch_prompts(args, src)
    slots = batch_slots(args, prompts)
    check_prompts(src.cfg, prompts, args.tokens)  # each prompt and its tokens fit a slot: refused before ranks start
    how = "the reference interpreter" if args.reference else "its plan for the cuda lane on the numpy backend"
    print(f"lanefuse: model: {src.name} ({R} ranks over gloo, each {how}; {len(prompts)} prompt(s) in {slots} "
          f"slot(s); greedy)", file=sys.stderr)
    t0 = time.perf_counter()
    res = launch(R, [dict(model=src.path, prompt=None, prompts=prompts, slots=slots, n_tokens=args.tokens,
                          chunk=min(max(len(p) for p in prompts), 512), max_len=src.cfg.max_len,
                          plan=not args.reference, eos=() if args.ignore_eos else tuple(src.eos))])[0]  # as run's batch
    dt = time.perf_counter() - t0
    human = sys.stderr if args.json == "-" else sys.stdout
    records = [{"model": src.name, "ranks": R, "prompt_ids": list(p), "generated_ids": [int(t) for t in b["tokens"]]}
               for p, b in zip(prompts, res[0]["batch"])]  # (the logits stay with the ranks, each its part)
    if args.json:
        from lanefuse.lane.lower.files import write_atomic

        write_atomic(args.json, json.dumps(records) + "\n")
    print_prompt_lines(records, tok, human)
    print(f"lanefuse: {R} ranks: {dt:.2f} s (process start-up included); {res[0]['calls']} collectives a rank, "
          f"{res[0]['bytes']:,} B sent a rank", file=sys.stderr)
    return 0


def check_ranks_cmd(args, src, rows_list: list[int]) -> int:
    """`lanefuse check --ranks R`: each step of R ranks (the reference interpreter's, engine/collectives.py) against
    the one-rank step on a random cache history: one line a step, a non-zero exit on any difference."""
    import numpy as np

    from lanefuse.engine.ranks import evaluate_ranks
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.front.parallel import build_rank_step, rank_carried, rank_weights

    cfg = _cfg(src, args.ranks, "check")
    R, bad = args.ranks, 0
    for rows in rows_list:
        rng = np.random.default_rng(rows)
        hist = 4
        tok = rng.integers(0, cfg.vocab, rows).astype(np.int32)
        one = {n: np.zeros(s, np.float32) for n, s in cfg.carried().items()}
        for n in one:
            one[n][:hist] = rng.standard_normal(one[n][:hist].shape).astype(np.float32)
        envs = []
        for r in range(R):  # each rank's part of the one rank's history: its KV heads' (a cache whole on every rank,
            e = rank_carried(cfg, one, r, R)  # DeepSeek-V3's latent: all of it), Qwen3-Next's rings and states its heads'
            e.update(token=tok, pos=np.asarray([hist], np.int32))
            envs.append(e)
        one.update(token=tok, pos=np.asarray([hist], np.int32))
        want = evaluate(build_step(cfg, rows), src.weights, one)
        got = evaluate_ranks([build_rank_step(cfg, r, R, rows) for r in range(R)],
                             [rank_weights(src.weights, cfg, r, R) for r in range(R)], envs)
        logits = np.concatenate([o["logits"] for o in got], axis=-1)
        rel = float(np.max(np.abs(logits - want["logits"])) / max(float(np.max(np.abs(want["logits"]))), 1e-30))
        same = all(np.array_equal(o["next"], want["next"]) for o in got)
        ok = same and rel <= 1e-4
        bad += not ok
        print(f"rows {rows}: {R} ranks against one: next token {'equal' if same else 'DIFFERENT'}, logits within "
              f"{rel:.2e} of their scale -> {'ok' if ok else 'FAIL'}")
    if bad:
        raise UserError(f"{bad} of {len(rows_list)} step(s) of {R} ranks differ from one rank's", code=1)
    return 0
