"""Plans travel: a Plan written as JSON (`save`) and read back (`load`) with no solver imported — the launches'
dataclasses by their class names, tuples as lists, everything else as plain JSON."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil

from lanefuse.engine.errors import UserError

FORMAT = "lanefuse-plan/2"  # /2: the record is a Plan (warnings, method, timings of its own)


def _classes() -> dict[str, type]:
    """Every dataclass the kernels package and the plan define, by name."""
    import lanefuse.kernels as kpkg

    out: dict[str, type] = {}
    mods = [importlib.import_module(f"lanefuse.kernels.{m.name}") for m in pkgutil.iter_modules(kpkg.__path__)
            if not m.name.startswith(("cupy", "compile"))]
    for m in mods:
        for v in vars(m).values():
            if isinstance(v, type) and dataclasses.is_dataclass(v):
                out[v.__name__] = v
    from lanefuse.engine.ir import Constant, StepIO, Tensor
    from lanefuse.lane.lower.arena import Arena, Placed
    from lanefuse.lane.lower.buffers import Buffer
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import Launched, Plan

    for v in (Plan, Launched, Buffer, Arena, Placed, Knobs, StepIO, Tensor, Constant):  # the plan's own records
        out[v.__name__] = v
    return out


def encode(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        d = {"_t": type(x).__name__}
        for f in dataclasses.fields(x):
            d[f.name] = encode(getattr(x, f.name))
        return d
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        return {str(k): encode(v) for k, v in x.items()}
    return x


def decode(x, classes: dict[str, type]):
    if isinstance(x, dict):
        if "_t" in x:
            cls = classes.get(x["_t"])
            if cls is None:
                raise UserError(f"the plan names a launch or record `{x['_t']}` this lanefuse does not know")
            kw = {}
            for f in dataclasses.fields(cls):
                if f.name in x:
                    v = decode(x[f.name], classes)
                    kw[f.name] = tuple(v) if isinstance(v, list) else v
            return cls(**kw)
        return {k: decode(v, classes) for k, v in x.items()}
    if isinstance(x, list):
        return [decode(v, classes) for v in x]
    return x


def save(plan, path: str) -> None:
    from lanefuse.lane.lower.files import write_atomic

    doc = {"format": FORMAT, "plan": encode(plan)}
    write_atomic(path, json.dumps(doc) + "\n")


def load(path: str):
    """The plan saved at `path`, checked whole before anything runs it (lane/lower/plancheck.py): the first bad
    field is a one-line error naming the file."""
    from lanefuse.lane.lower.plan import Plan
    from lanefuse.lane.lower.plancheck import Bad, Decoder, check

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read the plan: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: not a lanefuse plan (bad JSON: {e.msg})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not a lanefuse plan (not UTF-8 text: byte {e.start})") from None
    except RecursionError:
        raise UserError(f"{path}: not a lanefuse plan (JSON nested too deep)") from None
    if not isinstance(doc, dict) or "format" not in doc:
        raise UserError(f"{path}: not a lanefuse plan (expected format {FORMAT!r})")
    if doc["format"] != FORMAT:
        raise UserError(f"{path}: format: {str(doc['format'])[:40]!r}, but this lanefuse reads {FORMAT!r} "
                        f"(save the plan again with `lanefuse plan --save`)")
    extra = sorted(set(doc) - {"format", "plan"})
    if extra:
        raise UserError(f"{path}: {extra[0][:40]}: not a field of a lanefuse plan")
    try:
        p = Decoder(_classes()).record(doc.get("plan"), Plan, "")
        check(p)
    except Bad as e:
        raise UserError(f"{path}: {e}") from None
    except RecursionError:
        raise UserError(f"{path}: not a lanefuse plan (records nested too deep)") from None
    except (ArithmeticError, AttributeError, IndexError, KeyError, TypeError, ValueError) as e:  # a check's own slip
        raise UserError(f"{path}: the plan does not hold together ({type(e).__name__}: {str(e)[:80]})") from None
    return p
