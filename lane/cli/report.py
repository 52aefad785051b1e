"""What `lanefuse plan` and `lanefuse rules` print: the plan's launches, census, fusions, arena and cost (tables, or
JSON for scripts), and the rule table."""

from __future__ import annotations

import json
import os
import sys

from lanefuse.lane.lower.files import write_atomic


def _fields(l) -> str:
    """A launch's fields in one short line: names and numbers, placements as table[row]."""
    import dataclasses

    out = []
    for f in dataclasses.fields(l):
        v = getattr(l, f.name)
        if v is None or v is False or (f.name in ("first", "then", "parts", "sides", "phases")):
            continue
        if dataclasses.is_dataclass(v) and type(v).__name__ == "Dst":
            v = v.buf if v.row is None else f"{v.buf}[{v.row}]"
        elif dataclasses.is_dataclass(v):
            continue
        out.append(f"{f.name}={v}")
    if hasattr(l, "phases"):  # a chained launch: its phases' kinds, rows, outputs a warp and the attention's slot
        att = getattr(l, "attention", None)
        out += [f"phases={'+'.join(l.kinds())}", f"rows={l.glu.m}", f"per_warp={l.glu.per_warp}",
                *([f"slot={att.slot}"] if att is not None and att.slot else [])]
    return " ".join(out)


def launch_json(x) -> dict:
    from lanefuse.lane.lower.planfile import encode

    d = {"kind": x.launch.census, "layer": x.layer, "ops": list(x.ops), "class": x.cls, "rule": x.rule,
         "cost_us": round(x.cost_us, 4), "writes": list(x.launch.writes()), "reads": list(x.launch.reads())}
    d["fields"] = encode(x.launch)
    return d


def schedule_json(s) -> dict:
    per_layer = s.per_layer()
    return {
        "model": s.model, "rows": s.rows, "lane": s.lane, "numerics": s.numerics, "held": list(s.held),
        "launches": [launch_json(x) for x in s.launches if x.launch.kernels()],
        "census": s.census, "fusions": s.fusions, "layers": s.layers,
        "launches_per_layer": {str(k): v for k, v in sorted(per_layer.items())},
        "arena": s.arena.to_json(), "cost_us": round(s.cost_us, 3), "knobs": s.knobs.to_json(),
        "weight_bytes": weight_bytes_json(s),
        "warnings": list(s.warnings), "method": s.method,
        "f32_reads": [{"product": p, "why": w} for p, w in s.f32_reads],
        "timings_s": {k: round(v, 4) for k, v in s.timings.items()},
    }


def plan_from_args(args, src, g, traced: bool = False):
    """The plan of `g` under the command's flags (and the engine's result beside it where `traced`)."""
    from lanefuse.lane.cli.options import plan_options
    from lanefuse.lane.lower.plan import plan_traced

    from lanefuse.lane.cli.slow import spinner

    with spinner(f"planning {g.meta.get('model') or 'the step'} ({len(g.ops)} ops, {g.meta.get('rows', 1)} rows)…"):
        p, opt = plan_traced(g, plan_options(args), source=_source_of(src))
    return (p, opt) if traced else p


def _source_of(src) -> dict:
    if src.path is None:
        return {"kind": "demo"}
    return {"kind": "path", "path": os.path.abspath(src.path)}


def plan_command(args, src, g) -> int:
    s, opt = plan_from_args(args, src, g, traced=True)
    if args.trace:
        write_atomic(args.trace, json.dumps(opt.trace, indent=1, default=str) + "\n")
    if args.save:
        from lanefuse.lane.lower.planfile import save

        save(s, args.save)
    quiet = "-" in (args.json, args.save, args.trace)  # stdout holds one JSON document, nothing else
    why = why_not_notes(args, src, g) if args.json or not quiet else {}
    if args.json:
        write_atomic(args.json, json.dumps({**schedule_json(s), "rules": rule_counts(s, opt, args.rules, why_not=why)},
                                           indent=1) + "\n")
    if getattr(args, "html", None):
        _write_html(args, src, g)
    if quiet:
        return 0
    print_plan(s, args.layer, rule_counts(s, opt, args.rules, _released(args, g), why),
               full=bool(getattr(args, "all", False)))
    return 0


def _winner(instead: str) -> str:
    """The rule (or launch kind) the explorer's `instead` text names: `gemv_gate_up_glu`, or `merged_qkv` of `it
    computed inside launch #1 (fold, merged_qkv by `merged_qkv`)`."""
    import re

    m = re.search(r"by `([^`]+)`", instead)
    if m:
        return m.group(1)
    m = re.match(r"it computed inside launch (#\d+) \((\w+)", instead)
    if m:
        return f"launch {m.group(1)} ({m.group(2)})"
    return instead.split(" output ")[0]


def why_not_note(w: dict, method: str = "exact") -> str:
    """One line from the explorer's why-not of a rule (`Explorer.saturation()['rules'][i]['why_not']`): the cost
    difference of the step with the rule's fused op forced in at one tensor, and what the plan takes there."""
    t = w["tensor"]
    if w["support"] in ("refuse", "held"):
        return f"not chosen: {w['support']} at {t}: {w['reason']}"
    if w["plan_cost_us"] is None:
        return f"not chosen: no runnable plan takes it at {t} (a refusal conflicts)"
    d, win = w["plan_cost_us"] - w["step_us"], _winner(w["instead"])
    if abs(d) < 0.005:
        return f"not chosen: a tie at {t} with {win} ({w['step_us']:.2f} µs), broken by rank"
    if d > 0:
        return f"not chosen: +{d:.2f} µs a step with it at {t} ({w['plan_cost_us']:.2f} against {w['step_us']:.2f} " \
               f"µs with {win})"
    return f"not chosen: {d:+.2f} µs a step with it at {t}: cheaper, which the {method} search missed"


def _short_note(note: str) -> str:
    """A note in a few words for a narrow table (the whole sentence is on its `note:` line below): `+2.00 µs vs
    gemv_gate_up_glu`."""
    import re

    m = re.match(r"not chosen: ([+-][\d.]+ µs) a step with it at \S+ \(.* with (.+)\)$", note or "")
    if m:
        return f"{m.group(1)} vs {m.group(2)}"
    if (note or "").startswith("not chosen: a tie"):
        return "a tie, broken by rank"
    return (note or "").split(":")[0]


def why_not_notes(args, src, g) -> dict[str, str]:
    """rule -> why the plan never chose it, for each rule that matched in saturation and fused nothing in the plan
    (the explorer's why-not: the step's cost with the rule's op forced in at one tensor, against the plan's)."""
    from lanefuse.engine.errors import UserError, one_line
    from lanefuse.lane.cli.options import plan_options
    from lanefuse.lane.cli.slow import spinner
    from lanefuse.lane.explore.explorer import Explorer

    o = plan_options(args)
    try:
        with spinner("working out why the rules that matched were not chosen…"):
            ex = Explorer(g, lane=o.lane, rules_dirs=o.rules_dirs, knobs=o.knobs, held=o.held,
                          forced=o.forced or None, model_name=src.name, numerics=o.numerics)
            try:
                sat = ex.saturation()
            finally:
                ex.close()
    except UserError as e:  # the plan stands; only its notes are missing, and the user is told why
        print(f"lanefuse: the rules' why-not notes are left out: {one_line(e)}", file=sys.stderr)
        return {}
    method = "exact" if sat.get("method") == "ilp" else "local"
    return {r["name"]: why_not_note(r["why_not"], method) for r in sat["rules"]
            if r["matches"] and not r["fired"] and not r["held"] and isinstance(r["why_not"], dict)}


def _write_html(args, src, g) -> None:
    """`--html DIR`: the static report of the plan the flags make (lane/explore/report.py)."""
    from lanefuse.lane.cli.options import plan_options
    from lanefuse.lane.cli.slow import spinner
    from lanefuse.lane.explore.explorer import Explorer
    from lanefuse.lane.explore.report import write_report

    o = plan_options(args)
    with spinner(f"writing the report of {src.name} into {args.html}…"):
        ex = Explorer(g, lane=o.lane, rules_dirs=o.rules_dirs, knobs=o.knobs, held=o.held, forced=o.forced or None,
                      model_name=src.name + (" (shape only: no weights)" if src.shape_said else ""),
                      numerics=o.numerics)
        try:
            paths = write_report(ex, args.html)  # its header: the command line (sys.argv), version, date, knobs
        finally:
            ex.close()
    size = sum(os.path.getsize(p) for p in paths)
    print(f"lanefuse: report written: {os.path.join(args.html, 'index.html')} ({len(paths)} files, "
          f"{size / 1024:.0f} KiB; open it in a browser, no server needed)", file=sys.stderr)


def rule_counts(s, opt, rules_dirs=(), released=None, why_not: dict[str, str] | None = None) -> list[dict]:
    """Each rule of the table with its matches in saturation and the times the plan chose it, and what a user should
    know of it: held back (and whether `released`, the plan with the held rules released, chooses it), a user rule
    that never matched, a class the plan's lane does not link, why a rule that matched was never chosen (`why_not`,
    from `why_not_notes`)."""
    from lanefuse.engine.rules import load_table
    from lanefuse.lane.lower.table import load_lane

    table = load_table(tuple(rules_dirs or ()))
    matches = (opt.summary.get("saturation") or {}).get("matches", {}) if opt is not None else {}
    linked = load_lane(s.lane, tuple(rules_dirs or ())).linked()
    out = []
    for r in table.rules:
        m, c = int(matches.get(r.name, 0)), int(s.fusions.get(r.name, 0))
        notes = []
        if r.name in s.held:
            again = released.fusions.get(r.name, 0) if released is not None else None
            notes.append("held back" if again is None else
                         f"held back: released, the plan would choose it {again} times" if again else
                         "held back, and not chosen anyway: the plan with it released does not choose it")
        elif not str(r.file).startswith("rules/") and m == 0:
            notes.append("your rule never matched this step")
        if r.cls not in linked and r.cls != "into_row":
            notes.append(f"class `{r.cls}` is linked by no launch of the {s.lane} lane: never chosen")
        elif why_not and r.name in why_not and r.name not in s.held and m and not c:
            notes.append(why_not[r.name])
        out.append({"rule": r.name, "where": f"{r.file}:{r.line}", "class": r.cls, "matched": m, "chosen": c,
                    "note": "; ".join(notes)})
    return out


def _released(args, g):
    """The plan of `g` with its held rules released (held schedule steps stay held), to say whether a hold changed
    anything; None where no rule is held."""
    import dataclasses

    from lanefuse.engine.rules import load_table
    from lanefuse.lane.cli.options import plan_options
    from lanefuse.lane.lower.plan import plan

    o = plan_options(args)
    names = set(load_table(o.rules_dirs).by_name)
    if not any(h in names for h in o.held):
        return None
    return plan(g, dataclasses.replace(o, held=tuple(h for h in o.held if h not in names)))


def _kinds(launches) -> str:
    """A layer's launch kinds in order, runs compressed: `fold ×2, attention, gemv_glu, fold`."""
    kinds = [k.census for x in launches for k in x.launch.kernels()]
    out: list[list] = []
    for k in kinds:
        if out and out[-1][0] == k:
            out[-1][1] += 1
        else:
            out.append([k, 1])
    return ", ".join(k if n == 1 else f"{k} ×{n}" for k, n in out)


def layer_summary(s) -> list[tuple[str, int, str]]:
    """(layers, launches, kinds) for runs of equal layers (`1–35`), then the step's tail (outside every layer)."""
    by: dict[int, list] = {}
    for x in s.launches:
        if x.launch.kernels():
            by.setdefault(x.layer, []).append(x)
    rows: list[list] = []
    for i in sorted(k for k in by if k >= 0):
        n, kinds = sum(len(x.launch.kernels()) for x in by[i]), _kinds(by[i])
        if rows and rows[-1][2] == n and rows[-1][3] == kinds and rows[-1][1] == i - 1:
            rows[-1][1] = i
        else:
            rows.append([i, i, n, kinds])
    out = [(f"{a}" if a == b else f"{a}–{b}", n, k) for a, b, n, k in rows]
    tail = by.get(-1, [])
    if tail:
        computes = ", ".join(f"{', '.join(x.ops)} ({x.launch.census})" for x in tail)
        out.append(("tail", sum(len(x.launch.kernels()) for x in tail), computes))
    return out


def weight_bytes_json(s) -> dict:
    by = s.weight_bytes()
    return {"total": sum(by.values()), "by_format": by}


def weight_bytes_line(s) -> str:
    """The checkpoint bytes a step reads, e.g. `weights read a step: 2,472,960 B (q4_0)`, or by format."""
    by = s.weight_bytes()
    total = sum(by.values())
    if len(by) <= 1:
        return f"weights read a step: {total:,} B" + (f" ({next(iter(by))})" if by else "")
    return f"weights read a step: {total:,} B (" + ", ".join(f"{f} {n:,} B" for f, n in by.items()) + ")"


def print_plan(s, layer=None, rules: list[dict] | None = None, full: bool = False) -> None:
    """The plan on stdout, concise: its line, census, the rules that matched (`rules`, from `rule_counts`; why a rule
    that matched was not chosen in its note), every layer summarized with the step's tail, and `layer`'s launches
    where given (-1 the tail). `full` (`--all`): the census as a table, every rule, and layer 0's launches unless
    `layer` names another."""
    from lanefuse.lane.cli.tables import console, table

    con = console()
    per_layer = s.per_layer()
    body = [v for k, v in per_layer.items() if k >= 0]
    ctx = s.tensors[s.io.caches[0][0]].shape[0] if s.io.caches and s.io.caches[0][0] in s.tensors else None
    shape = f"{s.rows} row{'s' if s.rows > 1 else ''}"
    if s.batch > 1 and ctx:  # a batch's decode step: a row a sequence, each over its slot of the caches
        shape, ctx = f"a batch of {s.batch} sequences, a row each", f"{s.batch} slots of {ctx // s.batch}"
    con.print(f"[bold]{s.model}[/] · {shape} · lane [bold]{s.lane}[/] · {s.numerics}"
              + (f" · KV cache {ctx} rows" if ctx else "") + (f" · held: {', '.join(s.held)}" if s.held else ""))
    con.print(f"launches: [bold]{s.n_launches}[/] a step"
              + (f", {min(body)}–{max(body)} a layer" if body and min(body) != max(body) else
                 f", {body[0]} a layer" if body else "")
              + f" over {s.layers} layers · estimated step {s.cost_us:.1f} µs")
    con.print(f"arena {s.arena.bytes:,} B (lower bound {s.arena.lower_bound:,} B, ×{s.arena.ratio:.3f})")
    con.print(weight_bytes_line(s))
    for w in s.warnings:
        con.print(f"[yellow]note:[/] {w}")
    if s.f32_reads:  # under q8 / q8x2: the products that read their activation f32, grouped by why
        why: dict[str, list[str]] = {}
        for p, w in s.f32_reads:
            why.setdefault(w, []).append(p)
        for w, ps in why.items():
            shown = ", ".join(f"`{p}`" for p in ps[:4]) + (f" and {len(ps) - 4} more" if len(ps) > 4 else "")
            con.print(f"{s.numerics}: {len(ps)} product(s) read their activation f32 ({shown}): {w}")
    qk = [n for n, t in s.tensors.items() if t.dtype == "q8k"]
    if qk:  # under q8 the products over K-quant rows read llama.cpp's q8_K form, which a norm's, a gate/up GEMV's, an
        # attention's or a mixture finalize's epilogue writes, or else a Quant launch (the other producers' epilogues
        # write only the 32-value form)
        by_quant = {w for x in s.launches for k in x.launch.kernels() if k.census == "quant" for w in k.writes()}
        n_q = sum(n in by_quant for n in qk)
        con.print(f"{s.numerics}: {len(qk)} activation(s) read by products over K-quant/iq4_xs rows quantized as "
                  f"llama.cpp's q8_K (blocks of 256): {len(qk) - n_q} in a producer's epilogue (a norm, a gate/up GEMV, "
                  f"an attention, a mixture's finalize), {n_q} by a Quant launch"
                  + (" (the other producers' epilogues write only the 32-value q8 form)" if n_q else ""))
    census = sorted(s.census.items(), key=lambda kv: -kv[1])
    if full:
        t = table("census")
        t.add_column("launch kind")
        t.add_column("count", justify="right")
        for k, v in census:
            t.add_row(k, str(v))
        con.print(t)
    else:
        con.print("census: " + ", ".join(f"{k} {v}" for k, v in census))
    if rules is None:
        f = table("fusions fired")
        f.add_column("rule", no_wrap=True)
        f.add_column("count", justify="right")
        for k, v in sorted(s.fusions.items()):
            f.add_row(k, str(v))
        idle = []
    else:
        shown = rules if full else [r for r in rules if r["matched"] or r["chosen"] or r["note"]]
        idle = [r["rule"] for r in rules if r not in shown]
        f = table("rules: matched in saturation, chosen by the plan" + ("" if full else " (those that matched)"))
        narrow = con.width < 110  # an 80-column terminal: the source is in the note lines below
        f.add_column("rule", no_wrap=True)  # a name whole, never folded mid-identifier (ellipsized where too narrow)
        if not narrow:
            f.add_column("source", no_wrap=True)
        f.add_column("matched", justify="right", no_wrap=True)
        f.add_column("chosen", justify="right", no_wrap=True)
        f.add_column("note", ratio=1)  # the one column that wraps, at spaces
        for r in shown:
            f.add_row(r["rule"], *([] if narrow else [r["where"]]), str(r["matched"]), str(r["chosen"]),
                      _short_note(r["note"]) if narrow else r["note"] or "")
    con.print(f)
    if idle:
        con.print(f"{len(idle)} more rules matched nothing in this step (`--all` lists them)")
    for r in rules or ():
        if r["note"]:
            con.print(f"[yellow]note:[/] {r['rule']} @ {r['where']}: {r['note']}")
    lay = table("every layer")
    for c in ("layer", "launches", "kinds, in order"):
        lay.add_column(c, justify="right" if c == "launches" else "left", no_wrap=c != "kinds, in order")
    for name, n, kinds in layer_summary(s):
        lay.add_row(name, str(n), kinds)
    con.print(lay)
    final = next((x for x in s.launches if "final_norm" in x.ops), None)
    if final is not None and final.layer >= 0:
        con.print(f"the final norm is fused into layer {final.layer}'s last {final.launch.census} launch")
    if layer is not None or full:
        show = 0 if layer is None else layer
        lt = table(f"layer {show} launches" if show >= 0 else "the step's tail: launches")
        for c in ("#", "kind", "class / rule", "computes", "µs", "fields"):
            lt.add_column(c, overflow="fold" if c == "fields" else "ellipsis", no_wrap=c in ("#", "kind", "µs"))
        for i, x in enumerate(s.launches):
            if x.layer != show or not x.launch.kernels():
                continue
            lt.add_row(str(i), x.launch.census, f"{x.cls} ({x.rule})" if x.cls else "-", ", ".join(x.ops),
                       f"{x.cost_us:.2f}", _fields(x.launch))
        con.print(lt)
    if layer is None and s.layers > 1:
        con.print(f"`--layer N` shows layer N's launches (0..{s.layers - 1}; -1: the step's tail); `--all` every "
                  f"table in full")


def rules_command(args) -> int:
    """`lanefuse rules`: the table; with `--check [DIR]`, every rule and lane table checked (DIR's added): errors
    (a broken class contract) one a line on stderr and exit 1, warnings (a class no lane links) on stdout."""
    import sys

    from lanefuse.engine.errors import UserError
    from lanefuse.engine.rules import check_rules_dir, contract_problems, load_table, rules_listing
    from lanefuse.lane.lower.table import known_lanes, load_lane

    dirs = list(args.rules or [])
    if args.check:
        dirs.append(args.check)
    table = load_table(dirs, contracts=args.check is None)
    rows = rules_listing(table)
    if args.check is not None:
        errors = contract_problems(table)
        linked: set[str] = set()
        lanes_ok = True
        for name in known_lanes(dirs):
            try:
                linked |= load_lane(name, dirs).linked()
            except UserError as e:  # a lane on a broken base reports its base's error: listed once
                errors.append(str(e))
                lanes_ok = False
        errors = list(dict.fromkeys(errors))
        print(f"rules: {len(rows)} rules load{' cleanly' if not errors else ''}; lanes: "
              f"{', '.join(sorted(known_lanes(dirs)))}")
        if lanes_ok:  # what each class's linking says needs every lane's table
            problems = check_rules_dir(args.check, linked) if args.check else \
                [f"class `{r.cls}` ({r.name}) is linked by no lane" for r in table.rules if r.cls not in linked]
            for p in problems:
                print(f"warning: {p}")
            unlinked = sorted({r.cls for r in table.rules} - linked)
            print("every class a rule makes is linked by some lane" if not unlinked else
                  f"classes no lane links: {', '.join(unlinked)}")
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 1 if errors else 0
    if args.json:
        write_atomic(args.json, json.dumps([{"name": n, "class": c, "source": w, "depends_on": d}
                                            for n, c, w, d in rows], indent=1) + "\n")
        return 0
    from lanefuse.lane.cli.tables import console, table

    t = table(f"rule table: {len(rows)} rules")
    for c in ("name", "class", "source", "depends on"):
        t.add_column(c, overflow="fold")
    for n, c, w, d in rows:
        t.add_row(n, c, w, ", ".join(d) or "-")
    console().print(t)
    return 0
