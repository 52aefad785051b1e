"""`lanefuse explore`: the Explorer in the terminal (a command loop with history and tab completion of rule, tensor
and knob names; scripted when stdin is not a terminal), or `--web`: the explorer's page on 127.0.0.1."""

from __future__ import annotations

import cmd
import difflib
import os
import shlex
import sys
import traceback

from lanefuse.engine.errors import UserError, one_line

HISTORY = os.path.join(os.path.expanduser("~"), ".lanefuse_explore_history")

COMMANDS = [  # (usage, what it does): `help` prints these
    ("rules", "the rule table and the lane's schedule steps: held, fired, what each builds on"),
    ("rule NAME", "a rule's source: name @ file:line, why, its pattern and YAML entry, matches and times chosen"),
    ("saturation", "the saturation iteration by iteration (matches per rule, e-graph size); why each rule that "
                   "matched was not chosen"),
    ("fired", "the fusions fired and the launch census"),
    ("launch N", "launch #N of the plan: its fields, CUDA functions with grid and block and their source, bytes, "
                 "µs, numpy twin"),
    ("choices [TENSOR]", "the tensor's alternatives: own cost, support, the step's cost if forced; without one, "
                         "the tensors that have alternatives"),
    ("why TENSOR|RULE", "why the plan computes the tensor its way, and why not the others; a rule: why it was not "
                        "chosen where it matched"),
    ("hold RULE", "hold a rule or schedule step back, re-plan, show the diff"),
    ("release RULE", "release a held rule or step"),
    ("force TENSOR N", "force the tensor's alternative #N (see `choices`)"),
    ("unforce TENSOR", "take a forced choice back"),
    ("knob [NAME VALUE]", "list the lane's knobs, or set one (also NAME=VALUE)"),
    ("plan [exact]", "the plan: launches, cost, arena, census; `exact` re-plans with the ILP"),
    ("exact [on|off]", "on: every change re-plans exactly (the ILP, as the first plan); off: by local search"),
    ("diff", "the plan against the one before the last change"),
    ("undo", "take the last change back (again: the one before)"),
    ("history [N]", "the changes so far; with N, go back to the plan after change N (0: the start)"),
    ("layer N", "layer N's launches"),
    ("pin", "pin the current configuration as A for `compare`"),
    ("compare [A [B]]", "A/B, each planned exactly: the pinned A (or plan file A) against the current plan (or plan "
                        "file B): launches, cost, arena, census, fusions, the launches only one side has"),
    ("save FILE", "write held rules, forced choices (each by what it is: op, rule, what it reads) and knobs as a plan "
                  "file (`lanefuse plan --spec FILE`)"),
    ("quit", "leave (also `exit`, Ctrl-D)"),
]


class Shell(cmd.Cmd):
    """The terminal explorer. A user error prints one line and the loop goes on; scripted (stdin not a terminal) it
    reads commands line by line with no prompt, and exits at EOF with status 1 when a command failed."""

    def __init__(self, ex, stdin, stdout):
        super().__init__(stdin=stdin, stdout=stdout)
        from rich.console import Console

        self.ex = ex
        self.interactive = _isatty(stdin) and _isatty(stdout)
        self.use_rawinput = self.interactive and stdin is sys.stdin
        self.prompt = "lanefuse> " if self.interactive else ""
        self.console = Console(file=stdout, width=None if _isatty(stdout) else 140, highlight=False, markup=False,
                               soft_wrap=False)
        self.failed = False
        self._said_local = False  # the note that changes re-plan by local search, said once
        self._pinned: dict | None = None  # `pin`: the configuration A of `compare`

    # ---- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> None:
        rl = self._readline() if self.use_rawinput else None
        ex = self.ex
        self.console.print(f"lanefuse explore: {ex.model}, {ex.layers} layers, {len(ex.g.ops)} ops, lane "
                           f"{ex.lane.name}; {ex.plan().n_launches} launches, {ex.plan().cost_us:.2f} µs "
                           f"(exact plan in {ex.setup_ms:.0f} ms). `help` lists the commands.")
        try:
            while True:
                try:
                    self.cmdloop(intro="")
                    break
                except KeyboardInterrupt:
                    self.stdout.write("\n(interrupted: `quit` leaves)\n")
        finally:
            if rl is not None:
                try:
                    rl.write_history_file(HISTORY)
                except OSError:
                    pass

    def _readline(self):
        try:
            import readline
        except ImportError:
            return None
        try:
            readline.read_history_file(HISTORY)
        except (OSError, FileNotFoundError):
            pass
        readline.set_history_length(1000)
        readline.set_completer_delims(" \t\n=")
        return readline

    def onecmd(self, line: str) -> bool:
        """One command; its error, the user's or a bug of lanefuse's, is one line and the session (its held rules,
        forced choices and knobs) goes on."""
        try:
            return super().onecmd(line)
        except UserError as e:
            self._error(f"error: {e}")
        except OSError as e:  # the system refused a file the command named (`save DIR`, a full disk)
            where = f"{e.filename}: " if e.filename else ""
            self._error(f"error: {where}{e.strerror or e}")
        except Exception as e:  # a bug: one line (the traceback on request), and the session stays
            from lanefuse.engine import flags

            if flags.read("LANEFUSE_DEBUG") >= 1:
                traceback.print_exc(file=self._err())
            self._error(f"internal error: {type(e).__name__}: {_short(e)} (the session goes on; LANEFUSE_DEBUG=1 "
                        f"shows the traceback; please report it)")
        return False

    def _err(self):
        return sys.stderr if self.stdout is sys.stdout else self.stdout

    def _error(self, line: str) -> None:
        self.failed = True
        self.stdout.flush()
        print(one_line(line), file=self._err(), flush=True)

    def parseline(self, line: str):
        """Commands are case-insensitive (`HOLD RULE`); their arguments (tensor and rule names) are not."""
        cmd_, arg, line = super().parseline(line)
        if cmd_ and cmd_ != "EOF":
            low = cmd_.lower()
            line = low + line[len(cmd_):]
            cmd_ = low
        return cmd_, arg, line

    def emptyline(self) -> bool:
        return False

    def default(self, line: str) -> bool:
        word = line.split()[0]
        if word.startswith("#"):
            return False  # a comment in a script
        if word == "EOF":
            return self.do_quit("")
        names = [c.split()[0] for c, _ in COMMANDS] + ["help", "exit"]
        near = difflib.get_close_matches(word, names, n=1)
        raise UserError(f"unknown command `{word}`" + (f" (did you mean `{near[0]}`?)" if near else "")
                        + "; `help` lists the commands")

    def postcmd(self, stop: bool, line: str) -> bool:
        self.stdout.flush()
        return stop

    # ---- commands --------------------------------------------------------------------------------------------------
    def do_help(self, arg: str) -> None:
        from rich.table import Table

        t = Table(show_header=False, box=None, pad_edge=False)
        t.add_column(style="bold")
        t.add_column()
        for usage, what in COMMANDS:
            if not arg or usage.split()[0] == arg:
                t.add_row(usage, what)
        self.console.print(t)
        if not arg:
            self.console.print("Tab completes commands, rule, tensor and knob names. Tensors are named as in the "
                               "step graph (`L0.q`); `choices` numbers each tensor's alternatives.")

    def do_quit(self, arg: str) -> bool:
        return True

    do_exit = do_quit
    do_EOF = do_quit

    def do_rules(self, arg: str) -> None:
        from rich.table import Table

        st = self.ex.state()
        t = Table(title="rules and schedule steps", header_style="bold")
        for c, kw in (("rule", {}), ("class", {}), ("held", {}), ("fired", {"justify": "right"}),
                      ("builds on", {}), ("where", {"overflow": "fold"})):
            t.add_column(c, **kw)
        held = set(st["held"])
        for r in st["rules"]:
            blocked = [d for d in r["depends_on"] if d in held]
            mark = "held" if r["held"] else ("blocked by " + ", ".join(blocked) if blocked else "")
            t.add_row(r["name"], r["cls"], mark, str(r["fired"]), ", ".join(r["depends_on"]),
                      r["where"] if r["cls"] != "lane step" else os.path.basename(r["where"]))
        self.console.print(t)

    def do_rule(self, arg: str) -> None:
        name = self._one(arg, "rule NAME")
        st = self.ex.state()
        r = next((x for x in st["rules"] if x["name"] == name), None)
        if r is None:
            self.ex.rule_source(name)  # the error with its near names
            return
        c = self.console
        held = " (held)" if r["held"] else ""
        c.print(f"{r['where'] if r['cls'] != 'lane step' else r['name'] + ' @ ' + r['where']}{held}")
        c.print(f"  class: {r['cls']}")
        c.print(f"  why:   {r['why']}")
        if r["pattern"]:
            c.print("  pattern:")
            for line in r["pattern"]:
                c.print(f"    {line}")
        if r["depends_on"]:
            c.print(f"  builds on: {', '.join(r['depends_on'])}")
        sat = next((x for x in self.ex.saturation()["rules"] if x["name"] == name), None)
        if sat is not None:
            c.print(f"  matched {sat['matches']} times in saturation; fired {sat['fired']} times in this plan")
            w = sat["why_not"]
            if w:
                c.print(f"  not chosen: {w if isinstance(w, str) else w['text']}")
        else:
            c.print(f"  shaped {r['fired']} launches of this plan")
        if r["source"]:
            c.print("  source:")
            for line in r["source"].splitlines():
                c.print(f"    {line}")

    def do_saturation(self, arg: str) -> None:
        from rich.table import Table

        s = self.ex.saturation()
        eg = s["egraph"]
        t = Table(title=f"saturation: {len(s['iterations'])} iterations, stopped: {s['stop']}; e-graph "
                        f"{eg.get('nodes', '?')} e-nodes in {eg.get('classes', '?')} classes", header_style="bold")
        for col, kw in (("it", {"justify": "right"}), ("stage", {"justify": "right"}),
                        ("e-nodes", {"justify": "right"}), ("matches by rule", {"overflow": "fold"})):
            t.add_column(col, **kw)
        for it in s["iterations"]:
            m = it["matches"]
            t.add_row(str(it["iteration"]), str(it["stage"]), str(it["enodes"]),
                      "  ".join(f"{r} {m[r]}" for r in it["rules"]) or "(nothing new: the stage is saturated)")
        self.console.print(t)
        r = Table(title=f"rules: matched, chosen, and why not ({s['method']} plan, {s['cost_us']:.2f} µs)",
                  header_style="bold")
        for col, kw in (("rule", {}), ("matches", {"justify": "right"}), ("fired", {"justify": "right"}),
                        ("why not chosen (one place)", {"overflow": "fold"})):
            r.add_column(col, **kw)
        for x in s["rules"]:
            w = x["why_not"]
            r.add_row(x["name"], str(x["matches"]), str(x["fired"]),
                      "" if not w else w if isinstance(w, str) else w["text"])
        self.console.print(r)

    def do_launch(self, arg: str) -> None:
        word = self._one(arg, "launch N")
        try:
            n = int(word)
        except ValueError:
            raise UserError(f"launch {word}: give a launch's number (`layer N` lists them)") from None
        d = self.ex.launch(n)
        c = self.console
        rule = f" by `{d['rule']}`" if d["rule"] else ""
        c.print(f"launch #{d['index']}: {d['census']} ({d['kind']}), layer {d['layer']}, {d['cls'] or 'lifted'}"
                f"{rule}; computes {', '.join(d['tensors'])}")
        c.print(f"  {d['bytes']:,} bytes, {d['flops']:,} flops, estimated {d['cost_us']:.2f} µs; "
                f"{d['kernels']} kernel launch{'es' if d['kernels'] != 1 else ''}")
        c.print(f"  reads:  {', '.join(d['reads'])}")
        c.print(f"  writes: {', '.join(d['writes'])}")
        c.print("  fields:")
        for k, v in d["fields"].items():
            c.print(f"    {k} = {v!r}")
        for call in d["calls"]:
            c.print(f"  CUDA {call['function']}<<<grid {tuple(call['grid'])}, block {tuple(call['block'])}>>>  "
                    f"(module: prelude + {' + '.join(call['stems'])})")
        if d["calls_note"]:
            c.print(f"  CUDA: {d['calls_note']}")
        c.print(f"  numpy twin: {d['numpy']}" + (f"; fast twin: {d['fast']}" if d["fast"] else "")
                + f"  ({d['source_file']})")
        for f in d["functions"]:
            if f["source"]:
                c.print(f"  --- {f['function']} @ {f['file']}:{f['line']}")
                for line in f["source"].splitlines():
                    c.print(f"  {line}")

    def do_fired(self, arg: str) -> None:
        from rich.table import Table

        s = self.ex.plan()
        t = Table(title=f"fusions fired ({sum(s.fusions.values())})", header_style="bold")
        t.add_column("rule")
        t.add_column("count", justify="right")
        t.add_column("class")
        for r, n in sorted(s.fusions.items(), key=lambda kv: (-kv[1], kv[0])):
            t.add_row(r, str(n), self.ex.table.by_name[r].cls if r in self.ex.table.by_name else "")
        c = Table(title=f"launch census ({s.n_launches})", header_style="bold")
        c.add_column("launch kind")
        c.add_column("count", justify="right")
        for k, n in sorted(s.census.items(), key=lambda kv: (-kv[1], kv[0])):
            c.add_row(k, str(n))
        self.console.print(t)
        self.console.print(c)

    def do_choices(self, arg: str) -> None:
        from rich.table import Table

        if not arg.strip() or arg.strip() == "--all":
            self._list_choices(every=bool(arg.strip()))
            return
        tensor = self._one(arg, "choices [TENSOR]")
        ch = self.ex.choices(tensor)
        step = self.ex.plan().cost_us
        t = Table(title=f"{tensor}: {len(ch)} alternatives (step {step:.2f} µs)", header_style="bold")
        for c, kw in (("#", {"justify": "right"}), ("", {}), ("op / class", {}), ("rule", {}),
                      ("also computes", {"overflow": "fold"}), ("own µs", {"justify": "right"}), ("support", {}),
                      ("step µs if forced", {"justify": "right"}), ("reason", {"overflow": "fold"})):
            t.add_column(c, **kw)
        for c in ch:
            mark = ("●" if c["chosen"] else "") + ("⚑" if c["forced"] else "")
            op = c["op"] + (f" out {c['output']}" if "output" in c else "")
            also = ", ".join(x.split(".", 1)[1] if x.startswith(tensor.split(".")[0] + ".") else x
                             for x in c.get("also", []))
            t.add_row(str(c["index"]), mark, op, c["rule"] or "", also,
                      _us(c["cost_us"]), c["support"], _us(c["plan_cost_us"], "–"), c["reason"] or "")
        self.console.print(t)
        if not any(c["chosen"] for c in ch):
            self.console.print(f"{tensor} is computed inside a fused op that does not write it (`why {tensor}`).")

    def _list_choices(self, every: bool = False) -> None:
        """The tensors with alternatives; runs of layers whose tensors, alternatives and choices are alike (up to the
        layer's number) in one row each, as `plan` writes `0–34` (`choices --all`: a row a tensor)."""
        import re

        from rich.table import Table

        rows = self.ex.with_choices()
        by: dict[int, list[dict]] = {}
        for r in rows:
            by.setdefault(r["layer"], []).append(r)

        def alike(n: int) -> tuple:
            norm = lambda text: re.sub(rf"\bL{n}\.", "L*.", text or "")  # noqa: E731
            return tuple((norm(r["tensor"]), r["alternatives"], norm(r["chosen"]), r["forced"]) for r in by[n])

        runs: list[list[int]] = []
        for n in sorted(by):
            if not every and runs and runs[-1][-1] == n - 1 and n >= 0 and alike(runs[-1][0]) == alike(n):
                runs[-1].append(n)
            else:
                runs.append([n])
        merged = sum(len(r) > 1 for r in runs)
        t = Table(title=f"{len(rows)} tensors with alternatives (`choices TENSOR` lists one's"
                        + ("; equal layers in one row, `choices --all` a row each)" if merged else ")"),
                  header_style="bold")
        for c, kw in (("tensor", {"no_wrap": True}), ("layer", {"justify": "right", "no_wrap": True}),
                      ("alternatives", {"justify": "right"}), ("chosen", {"overflow": "fold"})):
            t.add_column(c, **kw)
        for run in runs:
            layer = str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}"
            for r in by[run[0]]:
                chosen = (r["chosen"] or "(inside a fused op)") + ("  ⚑ forced" if r["forced"] else "")
                t.add_row(r["tensor"], layer, str(r["alternatives"]), chosen)
        self.console.print(t)

    def do_undo(self, arg: str) -> None:
        if arg.strip():
            raise UserError("usage: undo  (`history N` goes back further at once)")
        self.ex.undo()
        self._print_diff()

    def do_history(self, arg: str) -> None:
        word = arg.strip()
        if word:
            try:
                n = int(word)
            except ValueError:
                raise UserError(f"history {word}: give a change's number from `history`, or 0 for the start") from None
            self.ex.goto(n)
            self._print_diff()
            return
        h = self.ex.history()
        if not h:
            self.console.print("no change yet: the first plan stands")
            return
        for k, e in enumerate(h, 1):
            self.console.print(f"{k:3d}  {e['what']}: {e['launches']} launches, {e['cost_us']:.2f} µs")
        self.console.print("`history N` goes back to the plan after change N (0: the start); `undo` one at a time")

    def do_exact(self, arg: str) -> None:
        word = arg.strip().lower()
        if word not in ("", "on", "off"):
            raise UserError("usage: exact [on|off]")
        if word:
            self.ex.set_what_if("ilp" if word == "on" else "local")
        how = ("every change re-plans exactly (the ILP)" if self.ex.what_if == "ilp" else
               "every change re-plans by local search (`exact on` keeps plans exact)")
        self.console.print(f"exact {'on' if self.ex.what_if == 'ilp' else 'off'}: {how}; the plan now: "
                           f"{self.ex.plan().cost_us:.2f} µs by {_method(self.ex.method)}")

    def do_why(self, arg: str) -> None:
        name = self._one(arg, "why TENSOR|RULE")
        if name not in self.ex.tensor_names():
            sat = next((x for x in self.ex.saturation()["rules"] if x["name"] == name), None)
            if sat is not None:  # a rule: matched, fired, and why it was not chosen where it was not
                w = sat["why_not"]
                said = (f"not chosen: {w if isinstance(w, str) else w['text']}" if w else
                        "chosen wherever it matched")
                self.console.print(f"{name}: matched {sat['matches']} times in saturation, fired {sat['fired']} "
                                   f"times in this plan; {said}")
                return
        self.console.print(self.ex.why(name))

    def do_hold(self, arg: str) -> None:
        self.ex.hold(self._one(arg, "hold RULE"))
        self._print_diff()

    def do_release(self, arg: str) -> None:
        self.ex.release(self._one(arg, "release RULE"))
        self._print_diff()

    def do_force(self, arg: str) -> None:
        words = arg.split()
        if len(words) != 2:
            raise UserError("usage: force TENSOR N  (N from `choices TENSOR`)")
        try:
            n = int(words[1])
        except ValueError:
            raise UserError(f"force {words[0]} {words[1]}: N is an alternative's number, e.g. 0") from None
        self.ex.force(words[0], n)
        self._print_diff()

    def do_unforce(self, arg: str) -> None:
        self.ex.unforce(self._one(arg, "unforce TENSOR"))
        self._print_diff()

    def do_knob(self, arg: str) -> None:
        words = arg.replace("=", " ").split()
        if not words:
            from rich.table import Table

            from lanefuse.lane.lower.knobs import Knobs

            t = Table(title="knobs", header_style="bold")
            t.add_column("knob")
            t.add_column("value", justify="right")
            t.add_column("default", justify="right")
            d = Knobs().to_json()
            for k, v in self.ex.knobs.to_json().items():
                t.add_row(k, str(v), "" if v == d[k] else str(d[k]))
            self.console.print(t)
            return
        if len(words) != 2:
            raise UserError("usage: knob NAME VALUE  (or knob NAME=VALUE; `knob` lists them)")
        self.ex.set_knob(words[0], words[1])
        self._print_diff()

    def do_plan(self, arg: str) -> None:
        if arg.strip() not in ("", "exact"):
            raise UserError("usage: plan [exact]")
        ex = self.ex
        s = ex.plan(exact=arg.strip() == "exact")
        c = self.console
        c.print(f"plan ({_method(ex.method)}, {ex.last_ms:.0f} ms): {s.n_launches} launches, {s.cost_us:.2f} µs, "
                f"arena {s.arena.bytes} B (lower bound {s.arena.lower_bound} B)")
        c.print("census:  " + "  ".join(f"{k} {n}" for k, n in s.census.items()))
        c.print("fusions: " + ("  ".join(f"{k} {n}" for k, n in s.fusions.items()) or "none"))
        c.print("held:    " + (", ".join(ex.held) or "nothing"))
        c.print("forced:  " + (", ".join(f"{t} #{i}" for t, i in ex.forced.items()) or "nothing"))
        per = s.per_layer()
        c.print("per layer: " + "  ".join(f"L{k}:{n}" if k >= 0 else f"step:{n}" for k, n in sorted(per.items())))
        for w in ex.warnings:
            c.print(f"note: {w}")

    def do_diff(self, arg: str) -> None:
        self._print_diff(always=True)

    def do_layer(self, arg: str) -> None:
        from rich.table import Table

        word = self._one(arg, "layer N")
        try:
            n = int(word)
        except ValueError:
            raise UserError(f"layer {word}: give a layer number 0..{self.ex.layers - 1}") from None
        st = self.ex.state(n)
        own = sum(g["layer"] == n for g in st["groups"])
        t = Table(title=f"layer {n}: {len(st['graph']['nodes'])} tensors in {len(st['groups'])} launches, {own} filed "
                        f"under layer {n} (`layer`: where `plan --layer N` lists each)", header_style="bold")
        for c, kw in (("#", {"justify": "right"}), ("layer", {"justify": "right"}), ("launch", {}),
                      ("class / op", {}), ("rule", {}), ("tensors", {"overflow": "fold"}), ("µs", {"justify": "right"})):
            t.add_column(c, **kw)
        for g in st["groups"]:
            t.add_row(str(g["index"]), "tail" if g["layer"] < 0 else str(g["layer"]), g["launch"], g["cls"] or "",
                      g["rule"] or "", ", ".join(g["tensors"]), f"{g['cost_us']:.2f}")
        self.console.print(t)

    def do_pin(self, arg: str) -> None:
        if arg.strip():
            raise UserError("usage: pin  (then change things and `compare`)")
        self._pinned = self.ex.spec()
        sp = self._pinned
        self.console.print(f"pinned as A: held {', '.join(sp['held']) or 'nothing'}; forced "
                           f"{', '.join(f'{t} #{i}' for t, i in sp['forced'].items()) or 'nothing'}; knobs "
                           f"{', '.join(f'{k}={v}' for k, v in sp['knobs'].items()) or 'the defaults'}")

    def do_compare(self, arg: str) -> None:
        from lanefuse.lane.lower.spec import load_spec

        words = shlex.split(arg)
        if len(words) > 2:
            raise UserError("usage: compare [A [B]]  (plan files; without them the pinned A and the current plan)")
        if words:
            a = load_spec(words[0])
            b = load_spec(words[1]) if len(words) == 2 else None
        else:
            if self._pinned is None:
                raise UserError("nothing pinned: `pin` the configuration A first, or give plan files (compare A [B])")
            a, b = self._pinned, None
        r = self.ex.compare(a, b)
        names = (words[0] if words else "A (pinned)", words[1] if len(words) == 2 else "B (current)")
        self._print_compare(r, names)

    def _print_compare(self, r: dict, names: tuple[str, str]) -> None:
        from rich.table import Table

        a, b, d = r["a"], r["b"], r["diff"]
        t = Table(title="A/B (each planned exactly)", header_style="bold")
        t.add_column("")
        t.add_column(names[0], overflow="fold")
        t.add_column(names[1], overflow="fold")
        t.add_column("B − A", justify="right")
        t.add_row("launches", str(a["launches"]), str(b["launches"]), f"{b['launches'] - a['launches']:+d}")
        t.add_row("cost µs", f"{a['cost_us']:.2f}", f"{b['cost_us']:.2f}", f"{b['cost_us'] - a['cost_us']:+.2f}")
        t.add_row("arena B", str(a["arena"]), str(b["arena"]), f"{b['arena'] - a['arena']:+d}")
        t.add_row("held", ", ".join(a["held"]) or "–", ", ".join(b["held"]) or "–", "")
        t.add_row("forced", ", ".join(f"{k} #{v}" for k, v in a["forced"].items()) or "–",
                  ", ".join(f"{k} #{v}" for k, v in b["forced"].items()) or "–", "")
        t.add_row("knobs", ", ".join(f"{k}={v}" for k, v in a["knobs"].items()) or "–",
                  ", ".join(f"{k}={v}" for k, v in b["knobs"].items()) or "–", "")
        for k, (x, y) in d["census"].items():
            t.add_row(f"census {k}", str(x), str(y), f"{y - x:+d}")
        for k, (x, y) in d["fusions"].items():
            t.add_row(f"fusion {k}", str(x), str(y), f"{y - x:+d}")
        self.console.print(t)
        self.console.print(f"{d['same']} launches alike; {len(d['only_a'])} only in A, {len(d['only_b'])} only in B")
        for side, rows in (("A", d["only_a"]), ("B", d["only_b"])):
            for x in rows[:12]:
                rule = f" by {x['rule']}" if x["rule"] else ""
                self.console.print(f"  only {side}: #{x['index']} {x['launch']} ({x['cls'] or 'lifted'}{rule}), layer "
                                   f"{x['layer']}: {', '.join(x['tensors'])}")
            if len(rows) > 12:
                self.console.print(f"  only {side}: … {len(rows) - 12} more")

    def do_save(self, arg: str) -> None:
        path = self._one(arg, "save FILE")
        self.ex.save(path)
        self.console.print(f"saved {path}: replay with `lanefuse plan --spec {shlex.quote(path)}`")

    # ---- helpers ---------------------------------------------------------------------------------------------------
    @staticmethod
    def _one(arg: str, usage: str) -> str:
        words = arg.split()
        if len(words) != 1:
            raise UserError(f"usage: {usage}")
        return words[0]

    def _print_diff(self, always: bool = False) -> None:
        d = self.ex.diff()
        c = self.console
        if d is None:
            c.print("no change yet: the first plan stands")
            return
        (lb, la), (cb, ca), (ab, aa) = d["launches"], d["cost_us"], d["arena"]
        c.print(f"{d['what']}: launches {lb} → {la} ({la - lb:+d}), cost {cb:.2f} → {ca:.2f} µs ({ca - cb:+.2f}), "
                f"arena {ab} → {aa} B  [{_method(d['method'])}, {d['ms']:.0f} ms]")
        if d["method"] != "ilp" and not self._said_local:
            self._said_local = True
            c.print("  (the first plan was exact; changes re-plan by local search: `exact on` keeps them exact, "
                    "`plan exact` re-plans this one)")
        if d["census"]:
            c.print("  census:  " + "  ".join(f"{k} {b}→{a}" for k, (b, a) in d["census"].items()))
        if d["fusions"]:
            c.print("  fusions: " + "  ".join(f"{k} {b}→{a}" for k, (b, a) in d["fusions"].items()))
        if not (d["census"] or d["fusions"]) and (lb, cb, ab) == (la, ca, aa):
            c.print("  the plan is unchanged")
        for w in d["warnings"]:
            c.print(f"  note: {w}")

    # ---- completion --------------------------------------------------------------------------------------------
    def _complete(self, text: str, names) -> list[str]:
        return [n for n in names if n.startswith(text)]

    def complete_hold(self, text, line, begidx, endidx):
        return self._complete(text, [r for r in self.ex.rule_names() if r not in self.ex.held])

    def complete_release(self, text, line, begidx, endidx):
        return self._complete(text, self.ex.held or self.ex.rule_names())

    def complete_choices(self, text, line, begidx, endidx):
        return self._complete(text, self.ex.tensor_names())

    complete_why = complete_choices

    def complete_force(self, text, line, begidx, endidx):
        if len(line[:begidx].split()) <= 1:
            return self._complete(text, self.ex.tensor_names())
        words = line.split()
        try:
            return self._complete(text, [str(c["index"]) for c in self.ex.choices(words[1])])
        except UserError:
            return []

    def complete_unforce(self, text, line, begidx, endidx):
        return self._complete(text, list(self.ex.forced))

    def complete_knob(self, text, line, begidx, endidx):
        if len(line[:begidx].split()) <= 1:
            return self._complete(text, self.ex.knob_names())
        return []

    def complete_rule(self, text, line, begidx, endidx):
        return self._complete(text, self.ex.rule_names())

    def complete_layer(self, text, line, begidx, endidx):
        return self._complete(text, [str(i) for i in range(self.ex.layers)])

    def complete_plan(self, text, line, begidx, endidx):
        return self._complete(text, ["exact"])


def _method(m: str) -> str:
    return "exact (ILP)" if m == "ilp" else "local search"


def _isatty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False


def _short(e: Exception, limit: int = 300) -> str:
    """An exception's message on one short line."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "…"


def _us(v, none: str = "∞") -> str:
    return none if v is None else f"{v:.2f}"
