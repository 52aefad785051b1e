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
        if not isinstance(i, int) or isinstance(i, bool):
            raise UserError(f"{path}: forced choice for {short(t)} must be an alternative's index (an integer)")
    for h in out.get("held", []):
        if not isinstance(h, (str, int)) or isinstance(h, bool):
            raise UserError(f"{path}: `held` is a list of rule (or schedule step) names, got {short(h)}")
    for k, v in out.get("knobs", {}).items():
        if not isinstance(k, str) or isinstance(v, (list, dict)):
            raise UserError(f"{path}: `knobs` maps a knob's name to a value, got {short(k)}: {short(v)}")
    out["held"] = [str(h) for h in out.get("held", [])]
    return out


def dump_spec(lane: str, numerics: str, held, knobs: dict, forced: dict, model: str | None = None) -> str:
    doc = {"lane": lane, "numerics": numerics, "held": sorted(held), "knobs": dict(knobs), "forced": dict(forced)}
    if model:
        doc["model"] = model
    return "# a lanefuse plan file: replay with `lanefuse plan --spec FILE`\n" + yaml.safe_dump(doc, sort_keys=False)
