"""The closed set of guard predicates a rule may name (`guards: [single_reader(r)]`): each one's arguments, what it
means in words, and the egglog query atoms it compiles to over the facts the e-graph loads about the step graph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# The facts the loader asserts for every original tensor (see egraph.py): Orig(t, name, index), Layer(t, layer),
# Cols(t, last dim), Depth(t, the longest chain of ops from the step's inputs to it), and the flags SingleReader(t), Values(t), Rows(t), StepNext(t),
# Unrotated(t) (a product's result that no rotation is computed from before the next product reads it).


@dataclass(frozen=True)
class Guard:
    name: str
    args: tuple[str, ...]  # "tensor" | "int"; a trailing "..." repeats the last
    doc: str
    compile: Callable[[list[str], Callable[[], str]], list[str]]  # (egglog arg texts, fresh var) -> query atoms
    # its atoms open the query: egglog 14 joins in the order it reads, and a guard that names the group (the layer)
    # keeps a pattern over tables every layer shares (cos, sin, pos) from pairing all layers first (20x slower at 80)
    lead: bool = False
    internal: bool = False  # the rule compiler's own (a joint key): no rule names it


def _ordered(args, fresh):
    idx = [fresh() for _ in args]
    atoms = [f"(Orig {a} {fresh()} {i})" for a, i in zip(args, idx)]
    atoms += [f"(< {a} {b})" for a, b in zip(idx, idx[1:])]
    return atoms


def _same(relation: str):
    """A guard that the tensors share one value of `relation` (T, i64): one fresh variable every atom names."""

    def compile(args, fresh):
        k = fresh()
        return [f"({relation} {a} {k})" for a in args]

    return compile


JOINT = 1 << 32  # a joint key: layer · JOINT + depth (or cols); depth and cols stay below it (egraph.py loads them)


def _cols_multiple(args, fresh):
    c = fresh()
    return [f"(Cols {args[0]} {c})", f"(= (% {c} {args[1]}) 0)"]


GUARDS: dict[str, Guard] = {g.name: g for g in [
    Guard("single_reader", ("tensor",), "the tensor has exactly one reader in the step graph",
          lambda a, f: [f"(SingleReader {a[0]})"]),
    Guard("is_step_next", ("tensor",), "the tensor is the step's next token",
          lambda a, f: [f"(StepNext {a[0]})"]),
    Guard("is_values", ("tensor",), "the tensor is a constant of f32 values (a bias, a norm weight)",
          lambda a, f: [f"(Values {a[0]})"]),
    Guard("is_rows", ("tensor",), "the tensor is a constant of checkpoint rows (a weight matrix)",
          lambda a, f: [f"(Rows {a[0]})"]),
    Guard("distinct", ("tensor", "tensor"), "the two tensors are different", lambda a, f: [f"(!= {a[0]} {a[1]})"]),
    Guard("ordered", ("tensor", "tensor", "..."),
          "the tensors are distinct and appear in this order in the step graph (picks one order of a group)", _ordered),
    Guard("same_layer", ("tensor", "tensor", "..."), "the tensors are computed in the same layer", _same("Layer"),
          lead=True),
    Guard("same_cols", ("tensor", "tensor", "..."), "the tensors' last dimensions are equal (one value a head of "
          "the same heads)", _same("Cols")),
    Guard("same_depth", ("tensor", "tensor", "..."), "the tensors are as many ops from the step's inputs (the longest "
          "chain), so neither is computed from the other: ops a bundle may run side by side", _same("Depth")),
    # `same_layer` with `same_depth` / `same_cols` over the same tensors, as the rule compiler joins them (egraph.py)
    Guard("same_layer_depth", ("tensor", "tensor", "..."), "the tensors are computed in the same layer, as many ops "
          "from the step's inputs", _same("LayerDepth"), lead=True, internal=True),
    Guard("same_layer_cols", ("tensor", "tensor", "..."), "the tensors are computed in the same layer, their last "
          "dimensions equal", _same("LayerCols"), lead=True, internal=True),
    Guard("unrotated", ("tensor",), "the tensor is a product's result from which no rotation is computed (walking "
          "its readers up to the next product, attention or mixture): a part that a rotated part's launch may carry "
          "unrotated (DeepSeek-V3's q_nope beside q_pe, its latent beside the rotated key)",
          lambda a, f: [f"(Unrotated {a[0]})"]),
    Guard("cols_multiple", ("tensor", "int"), "the tensor's last dimension is a multiple of the number",
          _cols_multiple),
]}
