"""`lanefuse explore`: the explorer for the command's arguments, in the terminal shell or on the web page."""

from __future__ import annotations

import sys

from lanefuse.engine.errors import UserError
from lanefuse.lane.explore.shell import Shell


def _open(args):
    """The explorer for the parsed arguments: the model, a plan file's choices, then --hold and --knob on top."""
    from lanefuse.lane.explore.explorer import Explorer
    from lanefuse.lane.cli.source import open_for
    from lanefuse.lane.lower.spec import load_spec

    if args.rows < 1:
        raise UserError(f"--rows {args.rows}: give at least 1")
    spec = load_spec(args.spec) if getattr(args, "spec", None) else {}
    src = open_for(args, args.model, progress=sys.stderr.isatty())
    if src.shape_said:  # a config-only folder: the shape alone, said as `plan` says it
        print(f"lanefuse: {src.shape_said}", file=sys.stderr)
    g = src.graph(args.rows)
    held = list(dict.fromkeys(list(spec.get("held", [])) + list(args.hold or [])))
    knobs = dict(spec.get("knobs", {}))
    for pair in args.knob or []:
        if "=" not in pair:
            raise UserError(f"--knob {pair!r}: expected NAME=VALUE, e.g. --knob sms=108")
        k, v = pair.split("=", 1)
        knobs[k.strip()] = v.strip()
    lane = args.lane or spec.get("lane") or "cuda"
    return Explorer(g, lane=lane, rules_dirs=tuple(args.rules or ()), knobs=knobs, held=held,
                    forced=spec.get("forced") or None,
                    model_name=src.name + (" (shape only: no weights)" if src.shape_said else ""),
                    what_if="ilp" if getattr(args, "exact", False) else "local",
                    numerics=getattr(args, "numerics", None) or spec.get("numerics") or "f32")


def explore_command(args, stdin=None, stdout=None) -> int:
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    ex = _open(args)
    try:
        if args.web:
            from lanefuse.lane.explore.server import serve, wait

            server, url = serve(ex, port=args.port)
            print(f"lanefuse explore: {ex.model}, {ex.layers} layers, serving {url}  (Ctrl-C to stop)", file=stdout,
                  flush=True)
            wait(server)
            return 0
        shell = Shell(ex, stdin, stdout)
        shell.run()
        return 1 if shell.failed and not shell.interactive else 0
    finally:
        ex.close()
