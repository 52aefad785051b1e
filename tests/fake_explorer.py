"""A stand-in for `lanefuse.lane.explore.Explorer` with realistic data: a Qwen3-0.6B-like decode step (28 layers) whose
fusions are picked by brute force over a small per-layer fusion table, so holding a rule, forcing a choice or setting a
knob changes the census, the cost, the arena and the groups the way the real engine would."""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass

from lanefuse.engine.errors import UserError

LAUNCH_US = 2.0  # fixed cost of one launch (µs)
BW = 3.3e6  # bytes a µs

HIDDEN, Q, KV, FFN, CTX = 1024, 2048, 1024, 3072, 4096

# tensor -> (lifted kind, shape, inputs); inputs not in this table are the layer's step inputs or constants
_LAYER = [
    ("attn_norm", "rmsnorm", [1, HIDDEN], ["x", "w_attn_norm"]),
    ("q", "matmul", [1, Q], ["attn_norm", "wq"]),
    ("k", "matmul", [1, KV], ["attn_norm", "wk"]),
    ("v", "matmul", [1, KV], ["attn_norm", "wv"]),
    ("q_norm", "rmsnorm", [1, Q], ["q", "w_q_norm"]),
    ("k_norm", "rmsnorm", [1, KV], ["k", "w_k_norm"]),
    ("q_rot", "rope", [1, Q], ["q_norm", "rope.cos", "rope.sin", "pos"]),
    ("k_rot", "rope", [1, KV], ["k_norm", "rope.cos", "rope.sin", "pos"]),
    ("kc", "set_row", [CTX, KV], ["k_cache", "k_rot", "pos"]),
    ("vc", "set_row", [CTX, KV], ["v_cache", "v", "pos"]),
    ("attn", "attention", [1, Q], ["q_rot", "kc", "vc", "pos"]),
    ("o", "matmul", [1, HIDDEN], ["attn", "wo"]),
    ("resid_attn", "add", [1, HIDDEN], ["x", "o"]),
    ("ffn_norm", "rmsnorm", [1, HIDDEN], ["resid_attn", "w_ffn_norm"]),
    ("gate", "matmul", [1, FFN], ["ffn_norm", "w_gate"]),
    ("up", "matmul", [1, FFN], ["ffn_norm", "w_up"]),
    ("gate_act", "silu", [1, FFN], ["gate"]),
    ("glu", "mul", [1, FFN], ["gate_act", "up"]),
    ("down", "matmul", [1, HIDDEN], ["glu", "w_down"]),
    ("resid_ffn", "add", [1, HIDDEN], ["resid_attn", "down"]),
]
_SHARED = {"rope.cos", "rope.sin", "pos"}  # step-wide names, not per layer
_LIFTED_LAUNCH = {"rmsnorm": "norm", "matmul": "gemv", "rope": "rope", "set_row": "set_row", "attention": "attention",
                  "add": "binary", "mul": "binary", "silu": "unary"}
_WORK_US = {  # bytes moved over bandwidth, beyond the launch's fixed cost
    "q": HIDDEN * Q * 2 / BW, "k": HIDDEN * KV * 2 / BW, "v": HIDDEN * KV * 2 / BW, "o": Q * HIDDEN * 2 / BW,
    "gate": HIDDEN * FFN * 2 / BW, "up": HIDDEN * FFN * 2 / BW, "down": FFN * HIDDEN * 2 / BW,
    "attn": 2 * 512 * KV * 4 / BW,  # a 512-position cache read
}


@dataclass(frozen=True)
class Fusion:
    key: str
    rule: str
    cls: str
    launch: str
    tensors: tuple[str, ...]
    saves_us: float = 0.3  # intermediate traffic that stays on chip


_FUSIONS = [
    Fusion("add_norm", "add_norm", "add_norm", "norm", ("resid_attn", "ffn_norm")),
    Fusion("gemv_norm_epilogue", "gemv_norm_epilogue", "gemv_norm_epilogue", "fold", ("o", "resid_attn", "ffn_norm"), 0.5),
    Fusion("merged_qkv", "merged_qkv", "merged_qkv", "gemm_parts", ("q", "k", "v"), 0.2),
    Fusion("qk_norm_rope.q", "qk_norm_rope", "qk_norm_rope", "rope", ("q_norm", "q_rot")),
    Fusion("qk_norm_rope.k", "qk_norm_rope", "qk_norm_rope", "rope", ("k_norm", "k_rot")),
    Fusion("rope_qk_one_launch", "rope_qk_one_launch", "rope_qk_one_launch", "rope_parts",
           ("q_norm", "q_rot", "k_norm", "k_rot"), 0.4),
    Fusion("glu_act_mul", "glu_act_mul", "glu_act_mul", "binary", ("gate_act", "glu")),
    Fusion("gemv_gate_up_glu", "gemv_gate_up_glu", "gemv_gate_up_glu", "gemv_glu", ("gate", "up", "gate_act", "glu"), 0.8),
]
# choices that never win: listed so a user sees why
_DECOMPOSE = [Fusion("qkv_head_epilogue", "qkv_head_epilogue", "qkv_head_epilogue", "fold",
                     ("q", "k", "v", "q_norm", "k_norm", "q_rot", "k_rot"))]
_DECOMPOSE_WHY = "the lane has no Fold of GemmParts with RopeParts yet: it runs the parts"
_REFUSED = {"kc": ("row_write_quant", "a quantized cache row under --numerics f32 (the cache holds f32 rows)"),
            "vc": ("row_write_quant", "a quantized cache row under --numerics f32 (the cache holds f32 rows)")}

_RULES = [
    ("add_norm", "add_norm", "a residual add and the RMSNorm of its sum, one launch that also writes the sum", []),
    ("norm_then_add", "norm_then_add", "sandwich norm: norm of (x + norm(y))", []),
    ("gemv_norm_epilogue", "gemv_norm_epilogue", "a projection, then add + norm in the same launch", ["add_norm"]),
    ("merged_qkv", "merged_qkv", "the products of one activation as one launch", []),
    ("qkv_head_epilogue", "qkv_head_epilogue", "a product whose heads are normed and rotated in its epilogue",
     ["merged_qkv", "qk_norm_rope"]),
    ("qk_norm_rope", "qk_norm_rope", "per-head norm + rope in one launch", []),
    ("rope_qk_one_launch", "rope_qk_one_launch", "q and k rotated in one launch", ["qk_norm_rope"]),
    ("glu_act_mul", "glu_act_mul", "act(g)·u in one launch", []),
    ("gemv_gate_up_glu", "gemv_gate_up_glu", "the gate and up products and the GLU in one launch", ["glu_act_mul"]),
    ("row_write_quant", "row_write_quant", "a cache row write carrying the row's quantized form", []),
    ("attn_output_gate", "attn_output_gate", "attention output gated by act(gate)", []),
    ("fused_sampling", "fused_sampling", "the arg-max and the advance of the next token and position", []),
    ("rows_a_warp", "lane step", "the schedule's four rows a warp for a wide product", []),
    ("gemv_parts", "lane step", "the decode step's products of one activation as one GEMV in parts", []),
    ("sequences", "lane step", "a batch's launches over its sequences as one", []),
]
_DEPENDS = {name: deps for name, _, _, deps in _RULES}


def _own_cost(tensor: str) -> float:
    return LAUNCH_US + _WORK_US.get(tensor, 0.05)


def _fusion_cost(f: Fusion) -> float:
    return LAUNCH_US + sum(_own_cost(t) - LAUNCH_US for t in f.tensors) - f.saves_us


class FakeExplorer:
    """Satisfies the Explorer protocol the web page is built against."""

    def __init__(self, layers: int = 28, model: str = "Qwen/Qwen3-0.6B (demo weights)"):
        self.model, self.layers = model, layers
        self.held: set[str] = set()
        self.forced: dict[str, int] = {}
        self.knobs: dict = {"numerics": "f32", "fuse_quant": False}
        self.layer = 0
        self._before: dict | None = None
        self._after: dict | None = None
        self._log: list[tuple[str, tuple]] = []
        self._start = self._config()

    # ---- names -------------------------------------------------------------------------------------------------
    def _split(self, tensor: str) -> tuple[int, str]:
        head, _, short = tensor.partition(".")
        if head.startswith("L") and head[1:].isdigit() and short in {t for t, *_ in _LAYER}:
            n = int(head[1:])
            if n < self.layers:
                return n, short
        names = [f"L{self.layer}.{t}" for t, *_ in _LAYER]
        near = difflib.get_close_matches(tensor, names, n=1)
        hint = f" (did you mean `{near[0]}`?)" if near else ""
        raise UserError(f"no tensor `{tensor}` in the step graph{hint}")

    def _rule(self, rule: str) -> None:
        names = [r for r, *_ in _RULES]
        if rule not in names:
            near = difflib.get_close_matches(rule, names, n=1)
            hint = f" (did you mean `{near[0]}`?)" if near else ""
            raise UserError(f"no rule `{rule}` in rules/fusions.yaml{hint}")

    # ---- extraction --------------------------------------------------------------------------------------------
    def _live(self) -> list[Fusion]:
        return [f for f in _FUSIONS if f.rule not in self.held and not (set(_DEPENDS[f.rule]) & self.held)]

    def _alternatives(self, short: str) -> list[tuple[str, Fusion | None]]:
        """A tensor's alternatives in a fixed order: its lifted op, then each fused class that contains it."""
        alts: list[tuple[str, Fusion | None]] = [("lifted", None)]
        alts += [("native", f) for f in self._live() if short in f.tensors]
        alts += [("decompose", f) for f in _DECOMPOSE if short in f.tensors and f.rule not in self.held]
        if short in _REFUSED and _REFUSED[short][0] not in self.held:
            alts.append(("refuse", None))
        return alts

    def _extract(self, layer: int, forced: dict[str, int]) -> tuple[float, list[Fusion]]:
        live = self._live()
        best: tuple[float, list[Fusion]] | None = None
        for n in range(len(live) + 1):
            for pick in itertools.combinations(live, n):
                used = [t for f in pick for t in f.tensors]
                if len(used) != len(set(used)):
                    continue
                if not self._obeys(pick, forced):
                    continue
                cost = sum(_fusion_cost(f) for f in pick) + sum(_own_cost(t) for t, *_ in _LAYER if t not in used)
                if best is None or cost < best[0] - 1e-9:
                    best = (cost, list(pick))
        if best is None:
            raise UserError("the forced choices conflict: no plan satisfies them all (unforce one)")
        return best

    def _obeys(self, pick, forced: dict[str, int]) -> bool:
        for short, index in forced.items():
            alts = self._alternatives(short)
            if index >= len(alts):
                continue  # a hold since removed this choice: the force no longer binds
            support, f = alts[index]
            owner = next((p for p in pick if short in p.tensors), None)
            if support == "lifted" and owner is not None:
                return False
            if support == "native" and owner is not f:
                return False
        return True

    def _forced_in(self, layer: int) -> dict[str, int]:
        return {t.partition(".")[2]: i for t, i in self.forced.items() if t.startswith(f"L{layer}.")}

    def _plan(self, layer: int) -> tuple[float, list[Fusion]]:
        return self._extract(layer, self._forced_in(layer))

    # ---- the whole step --------------------------------------------------------------------------------------------
    def _groups(self, picks: list[Fusion]) -> list[dict]:
        """Launches of one layer in order: each fused op once (at its first tensor), each other op alone."""
        groups, seen = [], set()
        for t, kind, *_ in _LAYER:
            f = next((p for p in picks if t in p.tensors), None)
            if f is None:
                groups.append({"launch": _LIFTED_LAUNCH[kind], "cls": kind, "rule": None, "tensors": [t]})
            elif f.key not in seen:
                seen.add(f.key)
                groups.append({"launch": f.launch, "cls": f.cls, "rule": f.rule, "tensors": list(f.tensors)})
        return groups

    def _summary(self) -> dict:
        census: dict[str, int] = {}
        fusions: dict[str, int] = {}
        cost = 0.0
        q8 = self.knobs["numerics"] == "q8"
        for n in range(self.layers):
            c, picks = self._plan(n)
            cost += c
            for g in self._groups(picks):
                census[g["launch"]] = census.get(g["launch"], 0) + 1
                if g["rule"]:
                    fusions[g["rule"]] = fusions.get(g["rule"], 0) + 1
            if q8:  # the activations the projections read: after attn_norm, attn, ffn_norm, glu
                if self.knobs["fuse_quant"]:
                    for r in ("norm_quant", "elementwise_quant", "add_norm_quant", "glu_act_mul_quant"):
                        fusions[r] = fusions.get(r, 0) + 1
                else:
                    census["quantize"] = census.get("quantize", 0) + 4
                    cost += 4 * LAUNCH_US
        # the head: embedding gather, final norm, lm_head, arg-max (+ advance unless fused_sampling)
        for kind in ("gather", "norm", "gemv", "argmax"):
            census[kind] = census.get(kind, 0) + 1
        cost += 4 * LAUNCH_US + HIDDEN * 151936 * 2 / BW
        if "fused_sampling" in self.held:
            census["binary"] = census.get("binary", 0) + 1
            cost += LAUNCH_US
        else:
            fusions["fused_sampling"] = 1
        return {"census": dict(sorted(census.items())), "launches": sum(census.values()), "cost_us": round(cost, 2),
                "fusions": dict(sorted(fusions.items())), "arena": self._arena(0)["bytes"]}

    def _arena(self, layer: int) -> dict:
        _, picks = self._plan(layer)
        groups = self._groups(picks)
        writer = {t: i for i, g in enumerate(groups) for t in g["tensors"]}
        shapes = {t: s for t, _, s, _ in _LAYER}
        # a tensor lives in the arena when a launch other than its own reads it (or it leaves the layer)
        arrays = []
        for t, kind, shape, _ in _LAYER:
            if kind == "set_row":
                continue  # caches are tables written in place, not step-local
            readers = [writer[u] for u, _, _, ins in _LAYER if t in ins and writer[u] != writer[t]]
            if t == "resid_ffn":
                readers.append(len(groups))  # the next layer reads it
            keeps = t == "resid_attn"  # add_norm keeps the sum
            if not readers and not keeps:
                continue
            last = max(readers) if readers else writer[t]
            arrays.append({"name": f"L{layer}.{t}", "first": writer[t], "last": last,
                           "bytes": shapes[t][0] * shapes[t][1] * 4})
        # largest first at the lowest aligned offset that overlaps no array alive at the same time
        placed: list[dict] = []
        for a in sorted(arrays, key=lambda a: (-a["bytes"], a["first"])):
            off = 0
            clash = sorted((p["offset"], p["offset"] + p["bytes"]) for p in placed
                           if not (p["last"] < a["first"] or a["last"] < p["first"]))
            for lo, hi in clash:
                if off + a["bytes"] <= lo:
                    break
                off = max(off, -(-hi // 256) * 256)
            a["offset"] = off
            placed.append(a)
        top = max((a["offset"] + a["bytes"] for a in placed), default=0)
        bound = max((sum(a["bytes"] for a in placed if a["first"] <= i <= a["last"]) for i in range(len(groups) + 1)),
                    default=0)
        placed.sort(key=lambda a: (a["first"], a["offset"]))
        return {"bytes": top, "lower_bound": bound, "launches": len(groups) + 1,
                "arrays": [{k: a[k] for k in ("name", "offset", "bytes", "first", "last")} for a in placed]}

    # ---- the protocol ------------------------------------------------------------------------------------------
    def state(self, layer: int | None = None) -> dict:
        if layer is not None:
            if not 0 <= int(layer) < self.layers:
                raise UserError(f"layer {layer} is out of range: the model has layers 0..{self.layers - 1}")
            self.layer = int(layer)
        n = self.layer
        _, picks = self._plan(n)
        groups = self._groups(picks)
        gid = {t: i for i, g in enumerate(groups) for t in g["tensors"]}
        p = f"L{n}."
        ids = {t for t, *_ in _LAYER}
        name = lambda t: t if t in _SHARED else p + t  # noqa: E731
        nodes = [{"id": p + t, "op": kind, "shape": shape, "group": gid[t]} for t, kind, shape, _ in _LAYER]
        edges = [[name(i), p + t] for t, _, _, ins in _LAYER for i in ins]
        inputs = sorted({name(i) for _, _, _, ins in _LAYER for i in ins if i not in ids})
        summary = self._summary()
        diff = None
        if self._before is not None:
            b, a = self._before, summary
            diff = {"launches": [b["launches"], a["launches"]], "cost_us": [b["cost_us"], a["cost_us"]],
                    "arena": [b["arena"], a["arena"]],
                    "census": {k: [b["census"].get(k, 0), a["census"].get(k, 0)]
                               for k in sorted(set(b["census"]) | set(a["census"]))
                               if b["census"].get(k, 0) != a["census"].get(k, 0)},
                    "fusions": {k: [b["fusions"].get(k, 0), a["fusions"].get(k, 0)]
                                for k in sorted(set(b["fusions"]) | set(a["fusions"]))
                                if b["fusions"].get(k, 0) != a["fusions"].get(k, 0)}}
        live = {f.rule for f in self._live()}
        per_layer = {r: sum(1 for f in _FUSIONS if f.rule == r) for r, *_ in _RULES}
        per_layer.update(qkv_head_epilogue=1, row_write_quant=2, fused_sampling=0)
        rules = []
        for r, cls, why, deps in _RULES:
            fired = 0
            if r not in self.held and not (set(deps) & self.held):
                fired = per_layer.get(r, 0) * self.layers if (r in live or r in ("qkv_head_epilogue", "row_write_quant")) else 0
                if r == "fused_sampling":
                    fired = 1
                if cls == "lane step":
                    fired = self.layers
            rules.append({"name": r, "cls": cls, "why": why, "held": r in self.held, "fired": fired,
                          "depends_on": deps})
        groups_out = [{"id": i, **g, "tensors": [p + t for t in g["tensors"]]} for i, g in enumerate(groups)]
        return {"model": self.model, "layers": self.layers, "layer": n,
                "graph": {"nodes": nodes, "edges": edges, "inputs": inputs},
                "groups": groups_out, "rules": rules, "knobs": dict(self.knobs), "forced": dict(self.forced),
                "census": summary["census"], "launches": summary["launches"], "cost_us": summary["cost_us"],
                "fusions": summary["fusions"], "arena": self._arena(n), "diff": diff, "history": self.history()}

    def choices(self, tensor: str) -> list[dict]:
        n, short = self._split(tensor)
        kind = next(k for t, k, *_ in _LAYER if t == short)
        forced = self._forced_in(n)
        now, picks = self._extract(n, forced)
        rest = self._summary()["cost_us"] - now  # the step's cost outside this layer
        owner = next((f for f in picks if short in f.tensors), None)
        out = []
        for i, (support, f) in enumerate(self._alternatives(short)):
            if support == "refuse":
                rule, why = _REFUSED[short]
                out.append({"index": i, "op": rule, "rule": rule, "cost_us": None, "support": "refuse",
                            "reason": why, "plan_cost_us": None, "chosen": False})
                continue
            if support == "decompose":
                parts = sum(_own_cost(t) for t in f.tensors)
                out.append({"index": i, "op": f.cls, "rule": f.rule, "cost_us": round(parts, 2),
                            "support": "decompose", "reason": _DECOMPOSE_WHY, "plan_cost_us": None, "chosen": False})
                continue
            plan, _ = self._extract(n, {**forced, short: i})
            own = _own_cost(short) if f is None else _fusion_cost(f)
            out.append({"index": i, "op": kind if f is None else f.cls, "rule": None if f is None else f.rule,
                        "cost_us": round(own, 2), "support": support, "reason": None, "plan_cost_us": round(rest + plan, 2),
                        "chosen": (owner is f) if f is not None else owner is None})
        return out

    def _change(self, fn, what: str = "change") -> None:
        before = self._summary()
        fn()
        self._before = before
        self._log.append((what, self._config()))

    def _config(self) -> tuple:
        return set(self.held), dict(self.forced), dict(self.knobs)

    def history(self) -> list[dict]:
        return [{"what": w, "launches": None, "cost_us": None} for w, _ in self._log]

    def undo(self) -> str:
        if not self._log:
            raise UserError("nothing to undo: the session has made no change")
        what = self._log[-1][0]
        self.goto(len(self._log) - 1)
        return what

    def goto(self, n: int) -> None:
        if not 0 <= n <= len(self._log):
            raise UserError(f"history entry {n}: the history has entries 0..{len(self._log)}")
        before = self._summary()
        held, forced, knobs = self._log[n - 1][1] if n else self._start
        self.held, self.forced, self.knobs = set(held), dict(forced), dict(knobs)
        del self._log[n:]
        self._before = before

    def set_what_if(self, method: str) -> None:
        if method not in ("ilp", "local"):
            raise UserError(f"what-if method `{method}`: local or ilp")

    def hold(self, rule: str) -> None:
        self._rule(rule)
        self._change(lambda: self.held.add(rule), f"hold {rule}")

    def release(self, rule: str) -> None:
        self._rule(rule)
        self._change(lambda: self.held.discard(rule), f"release {rule}")

    def force(self, tensor: str, index: int) -> None:
        n, short = self._split(tensor)
        alts = self._alternatives(short)
        if not 0 <= index < len(alts):
            raise UserError(f"`{tensor}` has choices 0..{len(alts) - 1}, not {index}")
        if alts[index][0] == "refuse":
            raise UserError(f"cannot force `{tensor}` to {_REFUSED[short][0]}: the lane refuses {_REFUSED[short][1]}")
        if alts[index][0] == "decompose":
            raise UserError(f"cannot force `{tensor}` to {alts[index][1].cls}: {_DECOMPOSE_WHY}")
        self._extract(n, {**self._forced_in(n), short: index})  # raises when it conflicts with another force
        self._change(lambda: self.forced.__setitem__(tensor, index), f"force {tensor} #{index}")

    def unforce(self, tensor: str) -> None:
        self._split(tensor)
        if tensor not in self.forced:
            raise UserError(f"`{tensor}` is not forced")
        self._change(lambda: self.forced.pop(tensor), f"unforce {tensor}")

    def set_knob(self, name: str, value) -> None:
        allowed = {"numerics": ("f32", "q8"), "fuse_quant": (True, False)}
        if name not in allowed:
            near = difflib.get_close_matches(name, allowed, n=1)
            hint = f" (did you mean `{near[0]}`?)" if near else ""
            raise UserError(f"no knob `{name}`{hint}; knobs: {', '.join(allowed)}")
        if value not in allowed[name] or (name == "fuse_quant" and not isinstance(value, bool)):
            raise UserError(f"knob `{name}` takes {' or '.join(map(str, allowed[name]))}, not {value!r}")
        self._change(lambda: self.knobs.__setitem__(name, value), f"knob {name}={value}")
