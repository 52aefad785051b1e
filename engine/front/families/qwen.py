"""Qwen2 (`Qwen2ForCausalLM`: q/k/v biases) and Qwen3 (`Qwen3ForCausalLM`: each head's q and k RMS-normed before the
rotation), Llama's step otherwise, and GGUF's `qwen2` / `qwen3`. Under `use_sliding_window` the layers from
`max_window_layers` on slide (where config.json has no `layer_types`, as transformers 5.x reads it)."""

from __future__ import annotations

from lanefuse.engine.front.family import Family
from lanefuse.engine.front.gguf_names import LAYER, QK_NORM, QKV_BIAS, Names
from lanefuse.engine.front.hfconfig import read_decoder


class Qwen(Family):
    name = "qwen"
    hf = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    gguf = {"qwen2": Names("Qwen2ForCausalLM", {**LAYER, **QKV_BIAS}),
            "qwen3": Names("Qwen3ForCausalLM", {**LAYER, **QK_NORM})}

    @classmethod
    def read_config(cls, c, arch, where, max_len, name):
        return read_decoder(c, arch, where, max_len, name, qkv_bias=arch == "Qwen2ForCausalLM",
                            qk_norm=arch == "Qwen3ForCausalLM", sliding=lambda i, n: i >= n)
