"""An expert mixture's routing, what the `moe` op means by its choice and what every consumer shares (the reference
interpreter, the kernels' twins, the tests): each row's chosen experts and their weights from the router's logits."""

from __future__ import annotations

import numpy as np


def route(logits: np.ndarray, k: int, norm_topk: bool, routing: str = "softmax_topk", choice_bias=None,
          groups: int = 1, topk_groups: int = 1, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k chosen experts and their weights from router logits (R, E), in f64: the softmax over every
    expert, the k largest probabilities in falling order (equal probabilities: the lower expert first, as the kernels
    choose; torch.topk leaves the order of equal values unspecified), renormalized to sum to 1 when `norm_topk`;
    routing `topk_softmax` (gpt-oss): the k largest logits, then the softmax over those k; routing `sigmoid_group`
    (DeepSeek-V3): the sigmoid of each logit, `choice_bias` (E,) added for the choice alone, the experts in `groups`
    equal groups of which the `topk_groups` of the largest sum of their two best are kept (equal sums: the lower
    group), the k best of the kept experts; their sigmoids the weights, renormalized when `norm_topk` (over the sum
    + 1e-20, as transformers), times `scale`. Returns (R, k) int64 experts and (R, k) f64 weights."""
    z = np.asarray(logits, dtype=np.float64)
    if routing == "topk_softmax":
        chosen = np.argsort(-z, axis=-1, kind="stable")[:, :k]
        top = np.take_along_axis(z, chosen, axis=-1)
        w = np.exp(top - top[:, :1])
        return chosen, w / w.sum(axis=-1, keepdims=True)
    if routing == "sigmoid_group":
        s = 1.0 / (1.0 + np.exp(-z))  # (R, E)
        c = s + (0.0 if choice_bias is None else np.asarray(choice_bias, dtype=np.float64))
        r, e = c.shape
        by_group = np.sort(c.reshape(r, groups, e // groups), axis=-1)  # (R, groups, E / groups), rising
        group_score = by_group[..., -2:].sum(axis=-1) if e // groups > 1 else by_group[..., -1]
        kept = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_groups]  # (R, topk_groups)
        mask = np.zeros((r, groups), dtype=bool)
        np.put_along_axis(mask, kept, True, axis=-1)
        c = np.where(np.repeat(mask, e // groups, axis=-1), c, -np.inf)
        chosen = np.argsort(-c, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(s, chosen, axis=-1)
        if norm_topk:
            w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
        return chosen, w * scale
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, chosen, axis=-1)
    if norm_topk:
        w = w / w.sum(axis=-1, keepdims=True)
    return chosen, w
