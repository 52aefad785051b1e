"""Sampling a step's next token from its logits on the host: temperature, top-k, top-p and min-p, each as
transformers' logits processors define it (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
MinPLogitsWarper, applied in that order, each keeping at least one token), then one draw from the kept tokens'
probabilities with a counter-based generator (numpy's Philox keyed by the seed, its counter the sequence and the
token's index): a token depends only on (seed, sequence, index, logits), not on how the run was split into steps,
chunks or batch slots. Temperature 0 is greedy: the plan's own arg-max, untouched (`Sampling.greedy`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lanefuse.engine.errors import UserError


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
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"--top-p {self.top_p}: give a value in (0, 1] (1: off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise UserError(f"--min-p {self.min_p}: give a value in [0, 1] (0: off)")
        if not 0 <= self.seed < 2**64:
            raise UserError(f"--seed {self.seed}: give an integer in 0..2^64-1")

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

    def scores(self, logits) -> np.ndarray:
        """The processed scores (float64): the logits over the temperature, -inf where top-k, top-p or min-p
        removes a token (transformers' warpers, in their order)."""
        s = np.asarray(logits, dtype=np.float64).reshape(-1) / self.temp
        if self.top_k:
            k = min(self.top_k, s.size)
            kth = np.partition(s, s.size - k)[s.size - k]
            s = np.where(s < kth, -np.inf, s)
        if self.top_p < 1.0:
            order = np.argsort(s, kind="stable")  # ascending, as TopPLogitsWarper sorts
            cum = np.cumsum(_softmax(s[order]))
            drop = cum <= 1.0 - self.top_p
            drop[-1] = False  # keep at least one
            s = s.copy()
            s[order[drop]] = -np.inf
        if self.min_p > 0.0:
            p = _softmax(s)
            drop = p < self.min_p * p.max()
            drop[int(np.argmax(p))] = False
            s = np.where(drop, -np.inf, s)
        return s

    def kept(self, logits) -> tuple[np.ndarray, np.ndarray]:
        """The tokens left to draw from, in id order, and their probabilities (summing to 1)."""
        s = self.scores(logits)
        ids = np.flatnonzero(np.isfinite(s))
        return ids, _softmax(s[ids])

    def uniform(self, seq: int, index: int) -> float:
        """The draw for token `index` of sequence `seq`: Philox(key=seed) at counter (index, seq, 0, 0), its first
        double in [0, 1)."""
        bits = np.random.Philox(key=self.seed, counter=[index, seq, 0, 0])
        return float(np.random.Generator(bits).random())

    def pick(self, logits, seq: int = 0, index: int = 0) -> int:
        """Token `index` of sequence `seq` drawn from `logits` (greedy: their arg-max, the first of ties)."""
        if self.greedy:
            return int(np.argmax(np.asarray(logits).reshape(-1)))
        ids, p = self.kept(logits)
        u = self.uniform(seq, index)
        j = int(np.searchsorted(np.cumsum(p), u, side="right"))
        return int(ids[min(j, ids.size - 1)])


def _softmax(s: np.ndarray) -> np.ndarray:
    m = np.max(s)
    e = np.exp(s - m)
    return e / e.sum()
