"""Plans travel: a Plan written as JSON (`save`) and read back (`load`) with no solver imported — the launches'
dataclasses by their class names, tuples as lists, everything else as plain JSON."""

from __future__ import annotations

import dataclasses
import hashlib
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


# What a digest covers: every field of the plan that reaches a kernel or says what it was planned from (its launches
# one digest each, so an edit is named by its place), not the engine's report (fusions, census, warnings, timings).
DIGESTED = ("model", "source", "rows", "lane", "numerics", "knobs", "held", "layers", "io", "tensors", "constants",
            "buffers", "arena")


def _digest(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


KEYED = ("tensors", "constants", "buffers")  # tables digested an entry each, so an edit is named by its key


def digests(record: dict) -> dict:
    """The digests of a plan's JSON record (as `save` writes it and `load` reads it): a field each of DIGESTED (the
    KEYED tables an entry each), one a launch."""
    out: dict = {}
    for k in DIGESTED:
        v = record.get(k)
        out[k] = {n: _digest(e) for n, e in v.items()} if k in KEYED and isinstance(v, dict) else _digest(v)
    launches = record.get("launches")
    out["launches"] = [_digest(x) for x in launches] if isinstance(launches, list) else []
    return out


def _well_formed(saved) -> bool:
    if not isinstance(saved, dict) or set(saved) != set(DIGESTED) | {"launches"}:
        return False
    if not isinstance(saved["launches"], list) or not all(isinstance(x, str) for x in saved["launches"]):
        return False
    return all(isinstance(saved[k], dict) and all(isinstance(x, str) for x in saved[k].values()) if k in KEYED
               else isinstance(saved[k], str) for k in DIGESTED)


def save(plan, path: str) -> None:
    from lanefuse.lane.lower.files import write_atomic

    record = json.loads(json.dumps(encode(plan)))  # the record as `load` reads it back: its digests the same
    doc = {"format": FORMAT, "plan": record, "digests": digests(record)}
    write_atomic(path, json.dumps(doc) + "\n")


def verify(record: dict, saved, p) -> None:
    """A loaded plan's record against the digests saved beside it: the first field (or launch) edited since
    `lanefuse plan --save` wrote it is refused, by name. A digest tells an edit, not a forgery: it proves the plan is
    the lowering that was saved, which `run --plan` then checks against the model (lane/run/step.py)."""
    from lanefuse.lane.lower.plancheck import Bad

    again = "; plan again and `lanefuse plan --save` (a saved plan is run only as it was planned)"
    if saved is None:
        raise Bad("digests", f"none: the plan carries no digests of what it holds (saved by an older lanefuse){again}")
    if not _well_formed(saved):
        raise Bad("digests", f"not the digests `lanefuse plan --save` writes{again}")
    now = digests(record)
    if len(saved["launches"]) != len(now["launches"]):
        raise Bad("launches", f"{len(now['launches'])} launches where the plan was saved with "
                              f"{len(saved['launches'])}: edited after it was saved{again}")
    for i, (a, b) in enumerate(zip(saved["launches"], now["launches"])):
        if a != b:
            raise Bad(f"launches[{i}] ({p.launches[i].launch.census})", f"edited after the plan was saved (its fields "
                                                                         f"are not the ones planned){again}")
    for k in DIGESTED:
        if saved[k] == now[k]:
            continue
        if k in KEYED and isinstance(now[k], dict):
            for n in sorted(set(saved[k]) | set(now[k])):
                if saved[k].get(n) != now[k].get(n):
                    what = ("added" if n not in saved[k] else "removed" if n not in now[k] else "edited")
                    raise Bad(f"{k}[{n[:60]!r}]", f"{what} after the plan was saved{again}")
        raise Bad(k, f"edited after the plan was saved{again}")


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
    extra = sorted(set(doc) - {"format", "plan", "digests"})
    if extra:
        raise UserError(f"{path}: {extra[0][:40]}: not a field of a lanefuse plan")
    try:
        p = Decoder(_classes()).record(doc.get("plan"), Plan, "")
        check(p)
        verify(doc["plan"], doc.get("digests"), p)
    except Bad as e:
        raise UserError(f"{path}: {e}") from None
    except RecursionError:
        raise UserError(f"{path}: not a lanefuse plan (records nested too deep)") from None
    except (ArithmeticError, AttributeError, IndexError, KeyError, TypeError, ValueError) as e:  # a check's own slip
        raise UserError(f"{path}: the plan does not hold together ({type(e).__name__}: {str(e)[:80]})") from None
    return p
