"""What one launch of a plan is, for the explorer: its kind's fields as planned, the CUDA functions it launches with
their grids and blocks (recorded by running its `cuda()` against a recording device env: no GPU, no CuPy), each
function's source from the kind's .cu files, its bytes, flops and estimated time, and its numpy twins' names."""

from __future__ import annotations

import dataclasses
import re
from functools import lru_cache

import numpy as np

from lanefuse.kernels.common import Launch
from lanefuse.kernels.compile import cu_text
from lanefuse.kernels.cupy_env import DeviceEnv


class _Recorder(DeviceEnv):
    """A DeviceEnv that allocates nothing: every pointer is 0, every table and scratch a stand-in, and each kernel
    function called is recorded with its grid and block instead of run."""

    def __init__(self):  # noqa: D107 - no device: DeviceEnv's own __init__ imports CuPy
        self.calls: list[dict] = []

    def array(self, name):
        return np.uint64(0)

    def weight(self, name):
        return (np.uint64(0), None)

    def param(self, name):
        return 0

    def ptr(self, name):
        return 0

    def opt(self, name):
        return np.uint64(0)

    def scratch(self, launch, s):
        return np.uint64(0)

    def table(self, key, words):
        return np.uint64(0)

    def host(self, name):
        return np.zeros(1)

    def function(self, stems, name):
        def call(grid, block, args, **kw):
            self.calls.append({"function": name, "stems": list(stems), "grid": list(_dims(grid)),
                               "block": list(_dims(block)), "shared_bytes": int(kw.get("shared_mem", 0) or 0)})
        return call


def _dims(d) -> tuple[int, ...]:
    return tuple(int(x) for x in (d if isinstance(d, (tuple, list)) else (d,)))


def cuda_calls(launch) -> list[dict] | str:
    """The kernel functions `launch.cuda()` calls, with grid and block; a string saying why where it cannot be told
    without a device."""
    rec = _Recorder()
    try:
        launch.cuda(rec)
    except Exception as e:  # a kind whose host side needs real device values: said, not guessed
        return f"not recorded without a device ({type(e).__name__}: {str(e)[:120]})"
    return rec.calls


def _body(text: str, start: int, paren: int) -> str:
    """`text` from `start` through the brace that closes the body opened after `paren`."""
    depth, i, opened = 0, paren, False
    while i < len(text):
        c = text[i]
        if c == "{":
            depth += 1
            opened = True
        elif c == "}":
            depth -= 1
            if opened and depth == 0:
                return text[start:i + 1]
        i += 1
    return text[start:]


def _defined(text: str, name: str) -> tuple[int, int] | None:
    """Where function `name` (a `__global__` or a `__device__` template) is defined in `text`: (start of its first
    line, template line included; its opening parenthesis)."""
    m = re.search(r"__(?:global|device)__[^;{]*?\b" + re.escape(name) + r"\s*(?:<[^>]*>)?\s*\(", text)
    if m is None or text.rfind("#define", text.rfind("\n", 0, m.start()), m.start()) != -1:
        return None
    start = text.rfind("\n", 0, m.start()) + 1
    prev = text.rfind("\n", 0, max(start - 1, 0)) + 1
    if text[prev:start].lstrip().startswith("template"):
        start = prev
    return start, m.end() - 1


@lru_cache(maxsize=None)
def function_source(stems: tuple[str, ...], name: str) -> tuple[str, str, int] | None:
    """The source of the kernel function `name` in the kind's .cu files: (file, text, line), or None. A kernel a
    macro stamps out (`GLU_KERNEL(gemv_glu_1, 1)`) is shown as the macro's definition, the line that stamps it and
    the device templates the macro calls (from any of the module's files)."""
    for stem in ("prelude",) + tuple(stems):
        text = cu_text(stem)
        line = lambda at: text.count("\n", 0, at) + 1  # noqa: E731
        hit = _defined(text, name)
        if hit is not None:
            return f"kernels/{stem}.cu", _body(text, hit[0], hit[1]), line(hit[0])
        m = re.search(r"^\s*(\w+)\(\s*" + re.escape(name) + r"\s*[,)].*$", text, re.M)
        if m is None:
            continue
        d = re.search(r"^#define\s+" + re.escape(m.group(1)) + r"\(.*?(?<!\\)$", text, re.M | re.S)
        if d is None:
            return f"kernels/{stem}.cu", m.group(0).strip(), line(m.start())
        macro = d.group(0)
        parts = []
        for callee in dict.fromkeys(re.findall(r"\b(\w+)\s*<", macro)):
            for other in dict.fromkeys((stem,) + tuple(stems)):  # its own file first, then the module's others
                src = cu_text(other)
                at = _defined(src, callee)
                if at is not None:
                    where = "" if other == stem else f"// from kernels/{other}.cu\n"
                    parts.append(where + _body(src, at[0], at[1]))
                    break
        parts += [macro, m.group(0).strip()]
        first = min([text.find(p) for p in parts if text.find(p) >= 0] or [d.start()])
        return f"kernels/{stem}.cu", "\n\n".join(parts), line(first)
    return None


def _field_value(v):
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _field_value(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_field_value(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


def launch_detail(x, index: int) -> dict:
    """One planned launch (`Launched`) as the explorer shows it."""
    l = x.launch
    kind = type(l)
    calls = cuda_calls(l)
    funcs = []
    if isinstance(calls, list):
        seen = set()
        for c in calls:
            key = (tuple(c["stems"]), c["function"])
            if key in seen:
                continue
            seen.add(key)
            src = function_source(*key)
            funcs.append({"function": c["function"], "file": src[0] if src else None,
                          "line": src[2] if src else None, "source": src[1] if src else None})
    twin = f"{kind.__module__.replace('lanefuse.', '')}.{kind.__name__}"
    return {
        "index": index, "census": l.census, "kind": kind.__name__, "layer": x.layer, "cls": x.cls, "rule": x.rule,
        "tensors": list(x.ops),
        "fields": {f.name: _field_value(getattr(l, f.name)) for f in dataclasses.fields(l)},
        "reads": list(l.reads()), "writes": list(l.writes()),
        "bytes": int(l.bytes()), "flops": int(l.flops()), "cost_us": round(x.cost_us, 4),
        "kernels": len(l.kernels()),
        "calls": calls if isinstance(calls, list) else [], "calls_note": None if isinstance(calls, list) else calls,
        "functions": funcs,
        "numpy": f"{twin}.numpy", "fast": f"{twin}.fast" if kind.fast is not Launch.fast else None,
        "source_file": f"{kind.__module__.replace('lanefuse.', '').replace('.', '/')}.py",
    }
