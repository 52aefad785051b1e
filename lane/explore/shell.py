"""`lanefuse explore`: the Explorer in the terminal (a command loop with history and tab completion of rule, tensor
and knob names; scripted when stdin is not a terminal), or `--web`: the explorer's page on 127.0.0.1."""

from __future__ import annotations

import cmd
import difflib
import os
import shlex
import sys
import traceback

from lanefuse.engine.errors import UserError

HISTORY = os.path.join(os.path.expanduser("~"), ".lanefuse_explore_history")

COMMANDS = [  # (usage, what it does): `help` prints these
    ("rules", "the rule table and the lane's schedule steps: held, fired, what each builds on"),
    ("fired", "the fusions fired and the launch census"),
    ("choices TENSOR", "the tensor's alternatives: own cost, support, the step's cost if forced"),
    ("why TENSOR", "why the plan computes the tensor its way, and why not the others"),
    ("hold RULE", "hold a rule or schedule step back, re-plan, show the diff"),
    ("release RULE", "release a held rule or step"),
    ("force TENSOR N", "force the tensor's alternative #N (see `choices`)"),
    ("unforce TENSOR", "take a forced choice back"),
    ("knob [NAME VALUE]", "list the lane's knobs, or set one (also NAME=VALUE)"),
    ("plan [exact]", "the plan: launches, cost, arena, census; `exact` re-plans with the ILP"),
    ("diff", "the plan against the one before the last change"),
    ("layer N", "layer N's launches"),
    ("save FILE", "write held rules, forced choices and knobs as a plan file (`lanefuse plan --spec FILE`)"),
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
        self.console = Console(file=stdout, width=None if _isatty(stdout) else 140, highlight=False,
                               soft_wrap=False)
        self.failed = False

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
        print(line, file=self._err(), flush=True)

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

        tensor = self._one(arg, "choices TENSOR")
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

    def do_why(self, arg: str) -> None:
        self.console.print(self.ex.why(self._one(arg, "why TENSOR")))

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
        c.print(f"plan ({ex.method} extraction, {ex.last_ms:.0f} ms): {s.n_launches} launches, {s.cost_us:.2f} µs, "
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
                f"arena {ab} → {aa} B  [{d['method']}, {d['ms']:.0f} ms]")
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

    def complete_layer(self, text, line, begidx, endidx):
        return self._complete(text, [str(i) for i in range(self.ex.layers)])

    def complete_plan(self, text, line, begidx, endidx):
        return self._complete(text, ["exact"])


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
