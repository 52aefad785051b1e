"""A static report of one plan to share (as PyTorch's tlparse writes one): `lanefuse plan MODEL --html DIR` writes
the explorer's own page with the plan's data beside it, to open from the file system with no server and no network —
the plan, the census, the fusions with their rules' source, the arena timeline and each layer's graph, every launch's
fields and CUDA code, the saturation step by step and each tensor's alternatives (their own costs and support; the
step's cost each alternative forced, within a time budget: past it, each says why it is missing), and a header that
says how the report was made (version, command line, date, model, lane, numerics, knobs, held rules). What-ifs are the
live page's: the report's controls say so."""

from __future__ import annotations

import importlib.resources
import json
import os

from lanefuse.engine.errors import UserError

ASSETS = ("app.js", "app.css", "favicon.svg")
DATA = "report.js"
STEP_COST_BUDGET_S = 20.0  # seconds of what-if searches (an alternative's step cost if forced) a report spends


def report_data(ex, header: dict | None = None, budget_s: float = STEP_COST_BUDGET_S) -> dict:
    """Everything the page asks the server for, answered once: the state of every layer (the whole-step parts kept
    once), every launch, the kernel sources by function, the saturation, each tensor's alternatives with the step's
    cost if forced to each (the live explorer's local search; within `budget_s`, past which an alternative carries
    `plan_cost_why` instead), and `header` (how the report was made)."""
    import time

    layers = []
    common = None
    for n in range(ex.layers):
        st = ex.state(n)
        layers.append({k: st[k] for k in ("layer", "graph", "groups", "arena")})
        common = {k: v for k, v in st.items() if k not in ("layer", "graph", "groups", "arena")}
    common["history"], common["diff"] = [], None
    launches, sources = [], {}
    for i in range(len(ex.plan().launches)):
        d = ex.launch(i)
        for f in d["functions"]:  # each kernel's source once, however many launches call it
            sources.setdefault(f["function"], {k: f[k] for k in ("file", "line", "source")})
            f.pop("source", None)
        launches.append(d)
    keep = ("index", "op", "rule", "output", "also", "cost_us", "support", "reason", "chosen", "forced",
            "plan_cost_us", "plan_cost_why")
    deadline = time.monotonic() + budget_s
    choices = {}
    for t in ex.tensor_names():
        alts = ex.alternatives(t)
        if len(alts) > 1:
            if time.monotonic() < deadline:
                alts = ex.choices(t)  # each with the step's cost if forced to it
                for c in alts:
                    if c.get("plan_cost_us") is None and c["support"] not in ("refuse", "held", "input"):
                        c["plan_cost_why"] = "no runnable plan takes it (a refusal or a forced choice conflicts)"
            else:
                for c in alts:
                    if not c["chosen"]:
                        c["plan_cost_why"] = (f"not worked out: the report spends at most {budget_s:.0f} s on what-ifs; "
                                              f"`lanefuse explore MODEL --web` works it out")
        for c in alts:
            if c["support"] in ("refuse", "held"):
                c["plan_cost_why"] = f"{c['support']}: {c.get('reason') or 'no plan takes it'}"
        choices[t] = [{k: c[k] for k in keep if k in c} for c in alts]
    return {"static": True, "common": common, "layers": layers, "launches": launches, "sources": sources,
            "saturation": ex.saturation(), "choices": choices, "header": header or report_header(ex)}


def report_header(ex, command: str | None = None) -> dict:
    """How a report was made: lanefuse's version, the command line, the date (UTC), the model, lane, numerics, the
    knobs that differ from the defaults, the held rules and the forced choices."""
    import datetime
    import shlex
    import sys

    from lanefuse.engine.version import version as _version
    from lanefuse.lane.lower.knobs import Knobs

    default = Knobs().to_json()
    st = ex.state(0)
    return {"version": _version(),
            "command": command or "lanefuse " + shlex.join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "model": ex.model, "rows": st["rows"], "layers": ex.layers, "lane": st["lane"], "numerics": st["numerics"],
            "knobs": {k: v for k, v in st["knobs"].items() if default.get(k) != v},
            "held": list(st["held"]), "forced": dict(st["forced"] or {})}


def write_report(ex, folder: str, header: dict | None = None) -> list[str]:
    """Write the report into `folder` (made if missing): index.html, the page's script and style, and report.js (the
    data, as a script: a page opened from file:// may load scripts but not fetch files). Whole or not at all: every
    file is made first in a fresh folder beside `folder`, which then becomes `folder` by one rename (where `folder`
    exists, each file moves in by one rename, after all are written); a failure leaves nothing behind. Answers the
    paths written."""
    import shutil
    import tempfile

    from lanefuse.lane.lower.files import _umask

    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"--html {folder}: is a file; give a folder for the report (it is made if missing)")
    web = importlib.resources.files("lanefuse.lane.explore").joinpath("web")
    html = web.joinpath("index.html").read_text(encoding="utf-8")
    if '<script src="app.js"></script>' not in html:
        raise RuntimeError("web/index.html lost its app.js script tag")
    html = html.replace('<script src="app.js"></script>', f'<script src="{DATA}"></script>\n<script src="app.js"></script>')
    html = html.replace("<title>lanefuse explore</title>", f"<title>lanefuse report · {_esc(ex.model)}</title>")
    data = json.dumps(_finite(report_data(ex, header)), allow_nan=False, separators=(",", ":"))
    data = data.replace("</", "<\\/")  # no `</script>` inside the script, whatever a name holds
    files = {"index.html": html, DATA: f"window.LANEFUSE_REPORT = {data};\n"}
    files.update({name: web.joinpath(name).read_text(encoding="utf-8") for name in ASSETS})
    parent = os.path.dirname(os.path.abspath(folder))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".lanefuse-report-")
    except OSError as e:
        raise UserError(f"--html {folder}: cannot make the folder: {e.strerror or e}") from None
    try:
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        os.chmod(tmp, 0o777 & ~_umask())
        if not os.path.exists(folder):
            os.rename(tmp, folder)
        else:
            for name in files:
                os.replace(os.path.join(tmp, name), os.path.join(folder, name))
    except OSError as e:
        raise UserError(f"--html {folder}: cannot write the report: {e.strerror or e}; nothing written") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [os.path.join(folder, name) for name in files]


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _finite(x):
    """JSON has no infinity: a refused choice's infinite cost goes as null (as the server sends it)."""
    import math

    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
