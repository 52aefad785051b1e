"""Sampling a step's next token: temperature, top-k, top-p and min-p as transformers' logits processors define them
(TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, in that order, each keeping at least
one token), then one draw from the kept tokens with a counter-based generator (Philox4x64-10 keyed by the seed, its
counter the token's index and the sequence): a token depends only on (seed, sequence, index, logits), not on how the
run was split into steps, chunks or batch slots. Temperature 0 is greedy: the plan's own arg-max, untouched
(`Sampling.greedy`).

The draw is the step's closing launch (kernels/sample.py, `sample`: `with_sampling` puts it where the plan's arg-max
closes the step, reading its settings and each sequence's (sequence, index) from the step input `sampling`, an i32
array a CUDA graph replay reads anew, the launch moving the index on as it moves the position), so neither backend
reads the logits back to draw. `Sampling.pick` is that launch's numpy twin on one row of logits — the same bits: the
reference interpreter's runs (which run no launch) draw with it, and the tests check the launch against it. What
the kept set means where it differs from transformers' float64 definition (f32 weights, ties on the top-p boundary):
kernels/sample.py's docstring."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.ir import StepIO, Tensor
from lanefuse.kernels import sample as twin

PARAMS = "sampling"  # the step input holding the draw's settings and each sequence's (sequence, index)


@dataclass(frozen=True)
class Sampling:
    temp: float = 0.0  # 0: greedy (the plan's arg-max)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int = 0

    def __post_init__(self):
        if not np.isfinite(self.temp) or self.temp < 0:
            raise UserError(f"--temp {self.temp}: give 0 (greedy) or more")
        if self.top_k < 0:
            raise UserError(f"--top-k {self.top_k}: give 0 (off) or more")
        if self.top_k >= 2**31:
            raise UserError(f"--top-k {self.top_k}: give at most {2**31 - 1} (0: off)")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"--top-p {self.top_p}: give a value in (0, 1] (1: off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise UserError(f"--min-p {self.min_p}: give a value in [0, 1] (0: off)")
        if not 0 <= self.seed < 2**64:
            raise UserError(f"--seed {self.seed}: give an integer in 0..2^64-1")
        with np.errstate(over="ignore"):
            t32 = np.float32(self.temp)
        if not self.greedy and (not np.isfinite(t32) or t32 == 0):
            raise UserError(f"--temp {self.temp}: outside f32's range (the draw divides the f32 logits by it)")

    @property
    def greedy(self) -> bool:
        return self.temp == 0.0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temp {self.temp:g}"]
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"min-p {self.min_p:g}"] if self.min_p > 0 else []
        return "sampling: " + ", ".join(parts) + f", seed {self.seed}"

    def words(self, pairs) -> np.ndarray:
        """The `sample` launch's parameter words: these settings and each (sequence, token index) of `pairs`."""
        return twin.params(self.temp, self.top_k, self.top_p, self.min_p, self.seed, pairs)

    def draw(self, logits, seq: int = 0, index: int = 0) -> twin.Draw:
        return twin.draw(np.asarray(logits, np.float32).reshape(-1), self.temp, self.top_k, self.top_p, self.min_p,
                         self.seed, seq, index)

    def kept(self, logits) -> tuple[np.ndarray, np.ndarray]:
        """The tokens left to draw from, in id order, and their probabilities (summing to 1; float64 of the launch's
        integer weights)."""
        d = self.draw(logits)
        ids = np.flatnonzero(d.kept)
        return ids, d.weights[ids].astype(np.float64) / float(d.total)

    def uniform(self, seq: int, index: int) -> float:
        """The draw for token `index` of sequence `seq` as a number in [0, 1): its 64 random bits / 2^64 (the first
        word of numpy's Philox(key=seed, counter=[index, seq, 0, 0]))."""
        return twin.draw_bits(self.seed, seq, index) / 2.0 ** 64

    def pick(self, logits, seq: int = 0, index: int = 0) -> int:
        """Token `index` of sequence `seq` drawn from `logits` as the `sample` launch draws it (greedy: their arg-max,
        the first of ties)."""
        if self.greedy:
            return int(np.argmax(np.asarray(logits).reshape(-1)))
        return self.draw(logits, seq, index).token


@dataclass(frozen=True)
class SampledIO(StepIO):
    """A sampled step's names: the plain step's and the `sampling` parameter words, an input the step advances."""

    params: tuple[str, ...] = (PARAMS,)

    @cached_property
    def inputs(self) -> tuple[str, ...]:
        return StepIO.inputs.func(self) + self.params


def with_sampling(p):
    """Plan `p` drawing its next token with the `sample` launch where its arg-max closes the step (the one whose
    advance writes the token and position the next step reads), its parameter words the step input `sampling`
    (settings, then a (sequence, index) pair a sequence: one, or a batch's one a row). Refused in one line where the
    plan has no such arg-max."""
    from lanefuse.kernels.argmax import ArgMax
    from lanefuse.kernels.sample import Sample
    from lanefuse.lane.lower.buffers import Buffer
    from lanefuse.lane.lower.plan import census_of

    from lanefuse.kernels.fold import Fold

    def closing(l):  # the arg-max advancing the next token: a launch of its own, or the LM head's fold (head_argmax)
        a = l.then if isinstance(l, Fold) else l
        return a if isinstance(a, ArgMax) and a.out == p.io.next and a.advance is not None else None

    at = [i for i, x in enumerate(p.launches) if closing(x.launch) is not None]
    if len(at) != 1:
        raise UserError(f"sampling: the plan of {p.model} closes its step with {len(at)} arg-max launches advancing "
                        f"the next token (the draw takes the place of one); run it greedy (no --temp)")
    i = at[0]
    a = closing(p.launches[i].launch)
    s = Sample(a.x, a.out, a.n, PARAMS, a.rows, a.advance)
    why = s.check()
    if why is not None:
        raise UserError(f"sampling: {why.reason}")
    launches = list(p.launches)
    held = p.launches[i].launch  # the head's fold: its product, then the draw (two kernels: no kernel runs the pair)
    launches[i] = replace(p.launches[i], launch=replace(held, then=s) if isinstance(held, Fold) else s)
    io = SampledIO(**{f: getattr(p.io, f) for f in ("token", "position", "caches", "logits", "next", "states")})
    census = census_of(launches)  # counted as the plan counts them: a kernel each (the head's fold is now two)
    out = replace(p, launches=launches, io=io, census=census,
                  tensors={**p.tensors, PARAMS: Tensor(PARAMS, (s.words,), "i32")},
                  buffers={**p.buffers, PARAMS: Buffer(PARAMS, PARAMS, 0, s.words, "i32", "io")})
    from lanefuse.lane.lower.plancheck import check

    check(out)  # the plan as it runs, checked whole as a saved plan is: every arena array written before it is read
    return out
