"""The built-in demo model: a small Qwen3-shaped decoder with deterministic seeded random weights built in memory,
scaled so that greedy decoding wanders rather than repeating one token."""

from __future__ import annotations

import numpy as np

from lanefuse.engine.front.model import ModelConfig
from lanefuse.engine.front.weights import Weights

DEMO_SEED = 0


def demo_config(max_len: int = 256) -> ModelConfig:
    return ModelConfig(arch="Qwen3ForCausalLM", hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, inter=512,
                       vocab=512, eps=1e-6, rope_theta=10000.0, qk_norm=True, max_len=max_len, name="demo")


def random_arrays(cfg: ModelConfig, seed: int = DEMO_SEED) -> dict[str, np.ndarray]:
    """Every weight `cfg` names, seeded: embeddings of unit variance, projections of variance 1/fan_in (so each
    layer keeps the residual's scale), norm weights near 1."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in cfg.weight_names().items():
        if name.endswith("norm.weight"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            a = rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = a.astype(np.float32)
    return out


def demo_model(max_len: int = 256) -> tuple[ModelConfig, Weights]:
    cfg = demo_config(max_len)
    return cfg, Weights.from_dict(random_arrays(cfg), cfg)
