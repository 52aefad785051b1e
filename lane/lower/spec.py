"""Plan files: the choices that make a plan — lane, numerics, held rules and steps, knobs, forced choices — as YAML
that `lanefuse plan --spec FILE` replays and the explorer's `save FILE` writes."""

from __future__ import annotations

import yaml

from lanefuse.engine.errors import UserError, did_you_mean
from lanefuse.engine.yamlsafe import load_file, short

KEYS = {"lane": str, "numerics": str, "held": list, "knobs": dict, "forced": dict, "model": str}


def load_spec(path: str) -> dict:
    doc = load_file(path, what="the plan file")  # unreadable, not UTF-8, bad syntax, an alias bomb: a UserError
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise UserError(f"{path}: a plan file is a mapping with keys {', '.join(KEYS)}")
    out = {}
    for k, v in doc.items():
        if k not in KEYS:
            hint = did_you_mean(str(k), KEYS)
            raise UserError(f"{path}: unknown key `{short(k)}`{hint}; a plan file has {', '.join(KEYS)}")
        if v is None:
            continue
        if not isinstance(v, KEYS[k]):
            raise UserError(f"{path}: `{k}` must be a {KEYS[k].__name__}")
        out[k] = v
    forced = out.get("forced", {})
    for t, i in forced.items():
        if isinstance(i, dict):
            bad = sorted(set(map(str, i)) - set(CHOICE_KEYS))
            if bad or not isinstance(i.get("op"), str):
                raise UserError(f"{path}: forced choice for {short(t)}: a choice names its `op` (the lifted op or "
                                f"fused class) and may give {', '.join(k for k in CHOICE_KEYS if k != 'op')}"
                                + (f"; unknown {', '.join(map(short, bad))}" if bad else ""))
            continue
        if not isinstance(i, int) or isinstance(i, bool):
            raise UserError(f"{path}: forced choice for {short(t)} must be a choice (op, rule, ...) or an "
                            f"alternative's index (an integer)")
    for h in out.get("held", []):
        if not isinstance(h, (str, int)) or isinstance(h, bool):
            raise UserError(f"{path}: `held` is a list of rule (or schedule step) names, got {short(h)}")
    for k, v in out.get("knobs", {}).items():
        if not isinstance(k, str) or isinstance(v, (list, dict)):
            raise UserError(f"{path}: `knobs` maps a knob's name to a value, got {short(k)}: {short(v)}")
    out["held"] = [str(h) for h in out.get("held", [])]
    return out


CHOICE_KEYS = ("op", "rule", "output", "writes", "reads", "covers", "index")


def describe_choice(a, producer) -> dict:
    """What alternative `a` (engine.optimize.Alternative) is, in names that outlive a change of the rule set: the
    lifted op or fused class, the rule that made it, which output, what it writes, the computed tensors it reads and
    those it computes inside. `index` (the engine's index when saved) is a hint only."""
    op = a.op
    d = {"op": a.cls or (op.kind if op is not None else "input"), "rule": a.rule}
    if a.output is not None:
        d["output"] = a.output
    if op is not None:
        d["writes"] = list(op.outs)
        d["reads"] = [x for x in dict.fromkeys(op.ins) if x in producer]
        if op.fused:
            d["covers"] = [p.out for p in op.parts]
    d["index"] = a.index
    return d


def resolve_choice(tensor: str, want, alts, producer, where: str = "the plan file") -> int:
    """The engine's index of the alternative of `tensor` a plan file names: an index as it is, a described choice
    (`describe_choice`) by what it is; none or several alike is a UserError naming the tensor."""
    if not isinstance(want, dict):
        return want
    keys = [k for k in CHOICE_KEYS if k != "index" and k in want]
    hits = [a.index for a in alts
            if all(describe_choice(a, producer).get(k) == want[k] for k in keys)]
    if len(hits) > 1 and want.get("index") in hits:
        return want["index"]
    if len(hits) >= 1:
        return hits[0]
    said = want["op"] + (f" by rule `{want['rule']}`" if want.get("rule") else "")
    have = "; ".join(f"#{a.index} {a.label}" for a in alts)
    reads = ", ".join(want.get("reads") or []) or "no computed tensor"
    raise UserError(f"{where}: `{tensor}` is forced to {said} (reading {reads}), which the step's rules no longer "
                    f"make (a rule renamed, removed or held?); its alternatives now: {have}")


def dump_spec(lane: str, numerics: str, held, knobs: dict, forced: dict, model: str | None = None) -> str:
    doc = {"lane": lane, "numerics": numerics, "held": sorted(held), "knobs": dict(knobs), "forced": dict(forced)}
    if model:
        doc["model"] = model
    return "# a lanefuse plan file: replay with `lanefuse plan --spec FILE`\n" + yaml.safe_dump(doc, sort_keys=False)
