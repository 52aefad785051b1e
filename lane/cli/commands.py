"""What each `lanefuse` subcommand does, given its parsed arguments."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.lane.cli.prompts import _batch_prompts, _prompt_ids, batch_slots, print_prompt_lines
from lanefuse.lane.lower.files import json_text, write_atomic


def _tty() -> bool:
    return sys.stdout.isatty()


def cmd_run(args) -> int:
    from lanefuse.lane.run.generate import generate, generate_step_graph
    from lanefuse.lane.cli.options import plan_options
    from lanefuse.lane.cli.source import open_for

    t_start = time.perf_counter()
    if args.tokens < 1:
        raise UserError(f"--tokens {args.tokens}: give at least 1")
    if getattr(args, "model_opt", None) is not None:
        if args.model is not None and args.model != args.model_opt:
            raise UserError(f"-m {args.model_opt} and MODEL {args.model}: give the model once")
        args.model = args.model_opt
    sampling = _sampling(args)
    model, saved = args.model, None
    if getattr(args, "plan", None):
        from lanefuse.lane.lower.planfile import load

        given = [f"--{f}" for f in ("hold", "rules", "spec", "knob", "lane", "numerics") if getattr(args, f, None)]
        if given:
            raise UserError(f"--plan {args.plan}: the saved plan fixes {', '.join(given)} (it was planned under its "
                            f"own); drop them, or plan again with them and `lanefuse plan --save`")
        saved = load(args.plan)
        model = _model_of_plan(args.plan, saved, model)
    t_load = time.perf_counter()
    src = open_for(args, model, progress=_tty(), ctx=_cache_rows(saved))
    load_s = time.perf_counter() - t_load
    if src.no_weights:
        raise UserError(src.no_weights)
    if src.ctx_said:
        print(f"lanefuse: {src.ctx_said}", file=sys.stderr)
    if src.weights is None:
        raise UserError(f"{src.name}: the step YAML names no weights (add `weights: {{demo: true}}`, "
                        f"`{{checkpoint: PATH}}` or `{{random: SEED}}`)")
    if args.prompts or len(args.prompt_ids or ()) > 1 or args.batch is not None:
        if getattr(args, "ranks", 1) > 1:  # R processes, each its rank's batch steps (lane/cli/ranks.py)
            from lanefuse.lane.cli.ranks import run_ranks_batch

            return run_ranks_batch(args, src, sampling)
        return _run_batch(args, src, saved, load_s, sampling, t_start)
    ids, tok = _prompt_ids(args, src)
    if not args.prompt_ids and args.prompt is None:
        print(f"lanefuse: no --prompt-ids or --prompt given: the prompt is token id {ids[0]} (give --prompt-ids "
              f"1,2,3 or --prompt TEXT)", file=sys.stderr)
    if getattr(args, "ranks", 1) > 1:  # R processes, each its rank's step (lane/cli/ranks.py)
        from lanefuse.lane.cli.ranks import run_ranks

        return run_ranks(args, src, ids, sampling)
    step_fn, label = _step_fn(args, src, saved, sampling)
    human = sys.stderr if args.json == "-" else sys.stdout  # `--json -`: stdout holds the JSON only
    print(f"lanefuse: model: {src.name} ({label}; {sampling.describe()})", file=sys.stderr)
    print("prompt ids:   ", ",".join(map(str, ids)), file=human)
    if tok is not None:
        print("prompt:", args.prompt, file=human)  # the prompt echoed, as llama-cli does
    stream = _Stream(human, tok)
    try:
        if src.step is not None:
            res = generate_step_graph(src.step, src.weights, ids, args.tokens, step_fn=step_fn, progress=_tty(),
                                      keep_logits=bool(args.json), sampling=sampling, on_token=stream.token)
        else:
            # a saved plan is a decode step: row by row; else the lane's knob's chunks (numpy's BLAS and the tensor
            # cores both gain from big ones: a 512-token prompt ran in 1.0-1.2 s as one chunk, 2.1-6.0 s as 8 of 64,
            # demo CPU)
            chunk = 1 if saved is not None else plan_options(args).knobs.chunk_rows
            res = generate(src.cfg, src.weights, ids, args.tokens, step_fn=step_fn, chunk=chunk, progress=_tty(),
                           keep_logits=bool(args.json),  # the logits are kept only where --json writes them
                           sampling=sampling, on_token=stream.token)
    finally:
        stream.end()
    out = {"model": src.name, "prompt_ids": list(ids), "generated_ids": [int(t) for t in res.generated_ids]}
    from lanefuse.lane.cli.timings import print_timings, run_timings

    if tok is not None:
        print("generated ids:", ",".join(map(str, out["generated_ids"])), file=human)
    if sampling is not None and not sampling.greedy:
        import dataclasses

        out["sampling"] = dataclasses.asdict(sampling)
    out["timings"] = run_timings(load_s, res, getattr(step_fn, "spent", None), time.perf_counter() - t_start)
    if args.json:
        write_atomic(args.json, itertools.chain(_record_text(out, res.logits, f"--json {args.json}"), ["\n"]))
    sys.stdout.flush()
    print_timings(out["timings"])
    return 0


def _sampling(args):
    """The run's sampling flags as a Sampling (greedy unless --temp > 0); top-k/p, min-p or a seed without a
    temperature would do nothing, so they are refused in one line."""
    from lanefuse.lane.run.sampling import Sampling

    s = Sampling(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    if s.greedy:
        given = [f for f, v, off in (("--top-k", s.top_k, 0), ("--top-p", s.top_p, 1.0), ("--min-p", s.min_p, 0.0),
                                     ("--seed", s.seed, 0)) if v != off]
        if given:
            raise UserError(f"{', '.join(given)} without --temp: the run is greedy (the plan's arg-max); give "
                            f"--temp T > 0 to sample")
    return s


class _Stream:
    """The generated tokens written as each step ends: `generated ids: 5,6,...` (or, with a tokenizer, `text: ...`
    decoded as it grows), flushed token by token; `end()` closes the line."""

    def __init__(self, out, tok=None):
        self.out, self.tok, self.ids, self.shown, self.started = out, tok, [], "", False

    def token(self, t: int) -> None:
        if not self.started:
            self.out.write("text: " if self.tok is not None else "generated ids: ")
            self.started = True
        self.ids.append(int(t))
        if self.tok is None:
            self.out.write(("," if len(self.ids) > 1 else "") + str(int(t)))
        else:  # the text decoded so far; written where it only grows (a token mid-character waits for the next)
            text = self.tok.decode(self.ids)
            if text.startswith(self.shown) and not text.endswith("\ufffd"):
                self.out.write(text[len(self.shown):])
                self.shown = text
        self.out.flush()

    def end(self) -> None:
        if not self.started:
            return
        if self.tok is not None:
            text = self.tok.decode(self.ids)
            if text.startswith(self.shown):
                self.out.write(text[len(self.shown):])
            else:  # a later token changed what was shown: the whole text again
                self.out.write(f"\ntext: {text}")
        self.out.write("\n")
        self.out.flush()


def _record_text(rec: dict, logits, what: str):
    """A run's record as JSON text, `{"model", "prompt_ids", "generated_ids", "logits", "timings"}` as json.dumps
    writes it, in parts (for write_atomic to stream), its logits a row of text at a time: no list of Python floats for
    the whole run (8 times the f32 rows), nor the whole text at once in a file, so --json costs the run its logits."""
    head = {k: v for k, v in rec.items() if k != "timings"}
    yield json_text(head, what).rstrip("\n")[:-1] + ', "logits": ['
    for i, row in enumerate(logits):
        try:
            yield (", " if i else "") + json.dumps(np.asarray(row, np.float32).reshape(-1).tolist(), allow_nan=False)
        except ValueError:
            raise UserError(f"{what}: not written: it would hold a non-finite number (NaN or inf), which JSON "
                            f"cannot hold") from None
    yield '], "timings": ' + json_text(rec["timings"], what).rstrip("\n") + "}"


def _records_text(records, results, what: str):
    """A batch's records as a JSON list, in parts (`_record_text`)."""
    yield "["
    for k, (rec, r) in enumerate(zip(records, results)):
        if k:
            yield ", "
        yield from _record_text(rec, r.logits, what)
    yield "]\n"


BATCH_MEMORY = 0.5  # a batch's caches may take at most this share of the machine's memory


def _run_batch(args, src, saved, load_s: float, sampling, t_start: float) -> int:
    """`run` over a batch of prompts in --batch slots: each prefilled alone into its slot, then decoded with the
    others; a record a prompt, in the order given. stdout: a line a prompt (its ids and what it generated); stderr:
    the caches, the model and the timings block a single run prints, over the whole batch."""
    from lanefuse.lane.cli.source import _memory_bytes
    from lanefuse.lane.cli.timings import batch_timings, print_timings, run_timings
    from lanefuse.lane.run.batch import cache_bytes, check_prompts, generate_batch

    if src.step is not None:
        raise UserError(f"{src.name}: a step YAML is one step of its own; a batch needs a model (a checkpoint folder, "
                        f"a GGUF file or the demo)")
    if saved is not None:
        raise UserError(f"--plan {args.plan}: a saved plan is one step; a batch plans its own steps (drop --plan)")
    prompts, tok = _batch_prompts(args, src)
    slots = batch_slots(args, prompts)
    cfg = src.cfg
    check_prompts(cfg, prompts, args.tokens)  # each prompt and its tokens fit a slot: refused before anything runs
    need, mem = cache_bytes(cfg, slots), _memory_bytes()
    if mem and need > BATCH_MEMORY * mem:
        raise UserError(f"--batch {slots} with --ctx {cfg.max_len}: the KV caches of {slots} slots need "
                        f"{need / 2**30:.1f} GiB, more than {BATCH_MEMORY:.0%} of this machine's "
                        f"{mem / 2**30:.0f} GiB: give fewer slots or a smaller --ctx")
    human = sys.stderr if args.json == "-" else sys.stdout
    print(f"lanefuse: KV caches: {slots} slot(s) of {cfg.max_len} rows, {need / 2**20:.1f} MiB", file=sys.stderr)
    step_fn, label = _step_fn(args, src, None, sampling)
    print(f"lanefuse: model: {src.name} ({label}; {len(prompts)} prompt(s) in {slots} slot(s); {sampling.describe()})",
          file=sys.stderr)
    eos = () if args.ignore_eos else src.eos
    results = generate_batch(cfg, src.weights, prompts, args.tokens, slots, step_fn=step_fn, eos=eos,
                             keep_logits=bool(args.json),  # the logits are kept only where --json writes them
                             sampling=sampling)
    spent = getattr(step_fn, "spent", None)
    total_s = time.perf_counter() - t_start
    records = []
    for r in results:
        records.append({"model": src.name, "prompt_ids": list(r.prompt_ids),
                        "generated_ids": [int(t) for t in r.generated_ids],
                        "timings": run_timings(load_s, r, spent)})
    if args.json:
        write_atomic(args.json, _records_text(records, results, f"--json {args.json}"))
    print_prompt_lines(records, tok, human)
    print_timings(batch_timings(load_s, results, spent, total_s))  # the batch's, as a single run's: on stderr
    return 0


def _cache_rows(saved) -> int | None:
    """The KV caches' rows a saved plan was made for, a sequence's (a batch step's tables hold a slot a sequence): a
    run of it opens the model with as many."""
    if saved is None or not saved.io.caches:
        return None
    return int(saved.tensors[saved.io.caches[0][0]].shape[0]) // max(1, saved.batch)


def _model_of_plan(path: str, s, model: str | None) -> str | None:
    """The model the saved plan `s` (read from `path`) is run with: the one given, which must be the one the plan
    was made for, or else the one the plan names."""
    made = s.source.get("path") if s.source.get("kind") == "path" else None
    if model is None:
        if s.source.get("kind") not in ("demo", "path"):
            raise UserError(f"{path}: the plan was made for `{s.model}` without weights behind it; give MODEL")
        return made
    name = os.path.basename(os.path.normpath(model)) if model != "demo" else "demo"
    if s.model and name != s.model and (made is None or os.path.abspath(model) != made):
        raise UserError(f"{path}: the plan was made for `{s.model}`, not `{name}`")
    return model


def _step_fn(args, src, saved, sampling=None):
    """The step function generation runs: the reference interpreter, or a fused plan (the saved one, or planned
    under the command's flags) on the chosen backend; sampled (`sampling` not greedy), each plan closes its step with
    the `sample` launch (the reference draws with its twin on the host)."""
    if args.reference and getattr(args, "exact", False):
        raise UserError("--exact and --reference: the exact twins run a fused plan, the reference the lifted graph; "
                        "give one")
    fast = bool(getattr(args, "fast_twins", False))
    if fast and (args.reference or getattr(args, "exact", False)):
        other = ("--reference", "the reference the lifted graph") if args.reference else \
            ("--exact", "the exact twins as each kernel sums")
        raise UserError(f"--fast-twins and {other[0]}: the fast twins run a fused plan's launches by f32 BLAS, "
                        f"{other[1]}; give one")
    if args.reference:
        numerics = getattr(args, "numerics", None) or "f32"
        if numerics == "f32":
            return None, "reference interpreter"
        from lanefuse.engine.interp import evaluate
        from lanefuse.engine.formats.quantize import with_numerics

        under: dict = {}

        def reference(g, env):  # the lifted graph under --numerics: its activations quantized as a plan's are
            if id(g) not in under:
                under[id(g)] = (g, with_numerics(g, numerics))
            return evaluate(under[id(g)][1], src.weights, env)

        return reference, f"reference interpreter, {numerics} numerics"
    from lanefuse.engine import flags
    from lanefuse.lane.run.step import plan_step_fn

    opts = None
    if saved is None:
        from lanefuse.lane.cli.options import plan_options

        opts = plan_options(args)
    from lanefuse.lane.run.step import pick_device

    exact = bool(getattr(args, "exact", False))
    if (exact or fast) and pick_device(args.device) != "cpu":
        raise UserError(f"--{'exact' if exact else 'fast-twins'}: the {'exact' if exact else 'fast'} twins are the "
                        f"numpy backend's; run them with --device cpu")
    numerics = saved.numerics if saved is not None else opts.numerics
    if numerics == "q8" and not fast and pick_device(args.device) == "cpu":
        exact = True  # q8 on the CPU: the exact twins, llama.cpp's arithmetic (--fast-twins: f32 BLAS, 4-5x faster)
    return plan_step_fn(src.weights, args.device, opts, saved, args.plan or "", check=flags.read("LANEFUSE_CHECK") == 2,
                        sampling=sampling, exact=exact)


def cmd_plan(args) -> int:
    from lanefuse.lane.cli.source import open_for

    if args.rows < 1:
        raise UserError(f"--rows {args.rows}: give at least 1")
    src = open_for(args, args.model, progress=_tty())
    if src.shape_said:
        print(f"lanefuse: {src.shape_said}", file=sys.stderr)
    if args.batch > 1 and args.rows != 1:
        raise UserError(f"--batch {args.batch} --rows {args.rows}: a batch step decodes one row a sequence (each "
                        f"prompt is prefilled alone)")
    if getattr(args, "ranks", 1) > 1 and args.last > 1:
        raise UserError(f"--last {args.last} --ranks {args.ranks}: the ranks' steps give their last row's logits")
    if getattr(args, "ranks", 1) > 1:  # each rank's share and collectives (lane/cli/ranks.py)
        from lanefuse.lane.cli.ranks import plan_ranks

        return plan_ranks(args, src, args.rows)
    if args.last > 1 and args.batch > 1:
        raise UserError(f"--last {args.last} --batch {args.batch}: a batch step's logits are already every row's")
    if args.last > 1 and args.save:
        raise UserError(f"--last {args.last} --save {args.save}: a saved plan is a step `lanefuse run --plan` takes, "
                        f"whose logits are its last row's; plan it without --last")
    g = src.graph(args.rows, args.batch, args.last)
    if args.batch > 1 and src.cfg is not None:
        from lanefuse.lane.run.batch import cache_bytes

        print(f"lanefuse: KV caches: {args.batch} slots of {src.cfg.max_len} rows, "
              f"{cache_bytes(src.cfg, args.batch) / 2**20:.1f} MiB", file=sys.stderr)
    if args.layer is not None and not -1 <= args.layer < g.layers:
        raise UserError(f"--layer {args.layer}: {src.name} has layers 0..{g.layers - 1} (-1: the step's tail outside "
                        f"every layer)")
    if args.lifted:
        return _print_lifted(g, args)
    from lanefuse.lane.cli.report import plan_command

    return plan_command(args, src, g)


def _print_lifted(g, args) -> int:
    rows = []
    for op in g.ops:
        if args.layer is not None and op.layer != args.layer:
            continue
        attrs = " ".join(f"{k}={v}" for k, v in op.attrs)
        rows.append((op.kind, ", ".join(op.ins), op.out, "x".join(map(str, g.shape(op.out))), attrs))
    if args.json:
        write_atomic(args.json, json.dumps([dict(zip(("op", "inputs", "output", "shape", "attrs"), r))
                                            for r in rows], indent=1) + "\n")
        return 0
    from lanefuse.lane.cli.tables import console, table

    t = table(f"lifted step graph: {len(g.ops)} ops")
    for c in ("op", "inputs", "output", "shape", "attrs"):
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*r)
    console().print(t)
    return 0


def cmd_check(args) -> int:
    """Each plan against the reference interpreter on a step with a cache history: one line a step, the first
    divergent launch named, a non-zero exit on any difference."""
    import numpy as np

    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.lane.cli.report import plan_from_args
    from lanefuse.lane.run.numpy_runner import NumpyRunner
    from lanefuse.lane.cli.source import open_for

    src = open_for(args, args.model, progress=_tty())
    if src.weights is None:
        raise UserError(src.no_weights or f"{src.name}: the step YAML names no weights to check with")
    rows_list = args.rows or ([int(src.step.meta.get("rows", 1))] if src.step is not None else [1, 8])
    if getattr(args, "ranks", 1) > 1 and args.last > 1:
        raise UserError(f"--last {args.last} --ranks {args.ranks}: the ranks' steps give their last row's logits")
    if getattr(args, "ranks", 1) > 1:  # R ranks' step against one rank's (lane/cli/ranks.py)
        from lanefuse.lane.cli.ranks import check_ranks_cmd

        return check_ranks_cmd(args, src, rows_list)
    bad = 0
    for rows in rows_list:
        g = src.graph(rows, last=args.last)
        s = plan_from_args(args, src, g)
        rng = np.random.default_rng(rows)
        env = {n: np.zeros(g.tensors[n].shape, np.float32) for n in g.io.tables}
        hist = 4
        for n in env:
            env[n][:hist] = rng.standard_normal(env[n][:hist].shape).astype(np.float32)
        vocab = g.tensors[g.io.logits].shape[-1]
        env[g.io.token] = rng.integers(0, vocab, g.tensors[g.io.token].shape[0]).astype(np.int32)
        env[g.io.position] = np.asarray([hist], np.int32)
        ref = evaluate(with_numerics(g, s.numerics), src.weights, {k: v.copy() for k, v in env.items()})
        fast_env = {k: v.copy() for k, v in env.items()}
        try:
            out = NumpyRunner(s, src.weights, check=True).step(env, lifted=g)
        except UserError as e:
            print(f"rows {rows}: {s.n_launches} launches: DIVERGES: {e}")
            bad += 1
            continue
        # the fast twins `run` takes on the CPU (f32 BLAS, each launch bound once), the same step whole
        fast = NumpyRunner(s, src.weights, exact=False).step(fast_env)
        want = np.asarray(ref[g.io.logits], np.float64)
        ref_next = int(np.asarray(ref[g.io.next]).reshape(-1)[0])
        words = []
        ok = True
        for what, got in (("", out), ("fast twins: ", fast)):
            rel = float(np.max(np.abs(got[g.io.logits] - want.reshape(got[g.io.logits].shape)))
                        / max(np.max(np.abs(want)), 1e-30))
            same = int(got[g.io.next].reshape(-1)[0]) == ref_next
            ok = ok and same and rel <= 1e-4
            words.append(f"{what}next token {'equal' if same else 'DIFFERENT'}, logits within {rel:.2e} of their "
                         f"scale")
        bad += not ok
        under = f" (reference under {s.numerics})" if s.numerics != "f32" else ""
        print(f"rows {rows}: {s.n_launches} launches, fusions {sum(s.fusions.values())}: {'; '.join(words)}{under} "
              f"-> {'ok' if ok else 'FAIL'}")
    if bad:
        raise UserError(f"{bad} of {len(rows_list)} step(s) differ from the reference", code=1)
    return 0


def cmd_rules(args) -> int:
    from lanefuse.lane.cli.report import rules_command

    return rules_command(args)


def cmd_kernels(args) -> int:
    from lanefuse.lane.cli.kernels import kernels_command

    return kernels_command(args)


def cmd_explore(args) -> int:
    from lanefuse.lane.cli.explore import explore_command

    return explore_command(args)
