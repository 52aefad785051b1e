"""A transformers `config.json` (as 4.x writes it: rope_theta, rope_scaling; or 5.x: rope_parameters) read into a
`ModelConfig` in one typed pass: every size a positive integer, every number finite and in range, the heads dividing
as the step needs, each refusal naming the file and the key."""

from __future__ import annotations

import math
from typing import Any

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.family import for_hf
from lanefuse.engine.front.model import ModelConfig, read_layer_types

ROPE_TYPES = ("default", "linear", "llama3")
ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
MAX_LAYERS = 512  # the deepest released models have about 130; planning takes time and memory with the layers
MAX_SIZE = 1 << 31  # no size of a real model comes near; beyond it a shape's product overflows what numpy indexes


def show(v: Any) -> str:
    """A value echoed in a message, cut short."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


class Reader:
    """Typed reads of one config mapping; `where` names the file, `prefix` the enclosing key (`rope_scaling.`)."""

    def __init__(self, c: dict[str, Any], where: str, prefix: str = ""):
        self.c, self.where, self.prefix = c, where, prefix

    def _bad(self, key: str, v: Any, expected: str) -> UserError:
        return UserError(f"{self.where}: `{self.prefix}{key}` is {show(v)}; expected {expected}")

    def has(self, key: str) -> bool:
        return self.c.get(key) is not None

    def size(self, key: str, default: int | None = None) -> int:
        """A positive integer (a JSON integer, or a float with no fraction); `default` where the key is absent."""
        v = self.c.get(key)
        if v is None:
            if default is None:
                raise UserError(f"{self.where}: missing `{self.prefix}{key}` (a positive integer)")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
            raise self._bad(key, v, "a positive integer")
        if not 1 <= v <= MAX_SIZE:
            raise self._bad(key, v, f"a positive integer (1..{MAX_SIZE})")
        return int(v)

    def number(self, key: str, default: float, low: float = 0.0, high: float = math.inf,
               low_open: bool = True, expected: str = "a positive number") -> float:
        """A finite number in (low, high] (or [low, high] where not `low_open`)."""
        v = self.c.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._bad(key, v, expected)
        x = float(v)
        if not math.isfinite(x) or x > high or x < low or (low_open and x == low):
            raise self._bad(key, v, expected)
        return x

    def flag(self, key: str) -> bool:
        v = self.c.get(key)
        if v is None:
            return False
        if not isinstance(v, bool):
            raise self._bad(key, v, "true or false")
        return v

    def sizes(self, max_layers: int) -> tuple[int, int, int, int, int, int]:
        """A decoder's sizes: hidden, heads, layers (at most `max_layers`, checked before anything lists the layers'
        tensors; a checkpoint's count is checked too), intermediate, vocabulary and kv heads (dividing the heads)."""
        hidden, heads = self.size("hidden_size"), self.size("num_attention_heads")
        layers = self.size("num_hidden_layers")
        if layers > max_layers:
            raise UserError(f"{self.where}: `{self.prefix}num_hidden_layers` is {layers}; expected at most {max_layers}")
        inter, vocab = self.size("intermediate_size"), self.size("vocab_size")
        kv = self.size("num_key_value_heads", heads)
        if heads % kv:
            raise UserError(f"{self.where}: `{self.prefix}num_key_value_heads` {kv} does not divide "
                            f"`{self.prefix}num_attention_heads` {heads}")
        return hidden, heads, layers, inter, vocab, kv

    def text(self, key: str, default: str) -> str:
        v = self.c.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._bad(key, v, "a string")
        return v


def read_rope(r: Reader) -> tuple[float, tuple[tuple[str, Any], ...], float]:
    """rope_theta, the scaling entries (rope_type and its factors), partial rotary factor."""
    c, where = r.c, r.where
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    for key, v in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(v, dict):
            raise UserError(f"{where}: `{key}` is {show(v)}; expected a mapping (or null)")
    merged = {**scaling, **params}
    m = Reader(merged, where, "rope_parameters." if params else "rope_scaling.")
    top_theta = r.number("rope_theta", 10000.0)
    theta = m.number("rope_theta", top_theta)
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{where}: rope type `{show(kind)[1:-1] if isinstance(kind, str) else show(kind)}` is not "
                        f"supported (supported: {', '.join(ROPE_TYPES)})")
    if kind == "linear" and merged.get("factor") is None:
        raise UserError(f"{where}: linear rope scaling without a `factor`")
    if kind == "llama3":
        missing = [k for k in ROPE_KEYS if merged.get(k) is None]
        if missing:
            raise UserError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
    entries: list[tuple[str, Any]] = [("rope_type", kind)]
    if kind != "default":
        for k in ROPE_KEYS:
            if merged.get(k) is None:
                continue
            entries.append((k, m.size(k) if k == "original_max_position_embeddings" else m.number(k, 1.0)))
    if kind == "llama3":
        sc = dict(entries)
        if sc["low_freq_factor"] == sc["high_freq_factor"]:
            raise UserError(f"{where}: llama3 rope scaling with low_freq_factor equal to high_freq_factor "
                            f"({sc['low_freq_factor']}); they must differ")
    partial = m.number("partial_rotary_factor", r.number("partial_rotary_factor", 1.0, high=1.0,
                                                         expected="a number in (0, 1]"),
                       high=1.0, expected="a number in (0, 1]")
    return theta, tuple(entries) if kind != "default" else (), partial


def config_from_hf(c: dict[str, Any], where: str = "config.json", max_len: int = 512, name: str = "model") -> ModelConfig:
    """config.json `c` read by the family its `architectures` names (engine/front/family.py)."""
    archs = c.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise UserError(f"{where}: `architectures` is {show(archs)}; expected a list of names, e.g. "
                        f"[\"LlamaForCausalLM\"]")
    arch = archs[0] if archs else None
    return for_hf(arch, where).read_config(c, arch, where, max_len, name)


def read_decoder(c: dict[str, Any], arch: str, where: str, max_len: int, name: str, *, llama: bool = False,
                 windowed: bool = False, qkv_bias: bool = False, qk_norm: bool = False, sliding=None,
                 config: type[ModelConfig] = ModelConfig) -> ModelConfig:
    """A dense decoder's config.json (transformers' Llama and its cousins) as `config`: `llama` its MLP's activation
    and biases as the config says; `windowed` every layer over `sliding_window`; q/k/v biases (`qkv_bias`), per-head
    q/k norms (`qk_norm`); `sliding(i, n)` which layers slide under `use_sliding_window` where `layer_types` is
    absent (the Qwen families). Every FFN dense: a mixture family adds its experts (families/mixtures.py)."""
    r = Reader(c, where)
    act = r.text("hidden_act", "silu")
    if act not in (LLAMA_ACTS if llama else ("silu",)):
        known = ", ".join(LLAMA_ACTS) if llama else "silu"
        raise UserError(f"{where}: hidden_act `{act}` is not supported for {arch.replace('ForCausalLM', '')} "
                        f"(only {known})")
    if r.flag("mlp_bias") and not llama:
        raise UserError(f"{where}: mlp_bias is not supported for {arch.replace('ForCausalLM', '')}")
    if qk_norm and r.flag("attention_bias"):
        raise UserError(f"{where}: attention_bias is not supported for {arch.replace('ForCausalLM', '')}")
    if windowed and r.flag("attention_bias"):
        raise UserError(f"{where}: attention_bias (an o_proj bias) is not supported for "
                        f"{arch.replace('ForCausalLM', '')}")
    hidden, heads, layers, inter, vocab, kv = r.sizes(MAX_LAYERS)
    if r.has("head_dim"):
        head_dim = r.size("head_dim")
    elif hidden % heads:
        raise UserError(f"{where}: `num_attention_heads` {heads} does not divide `hidden_size` {hidden} "
                        f"(give `head_dim` where heads are not hidden_size / num_attention_heads wide)")
    else:
        head_dim = hidden // heads
    eps = r.number("rms_norm_eps", 1e-6)
    theta, scaling, partial = read_rope(r)
    if int(head_dim * partial) < 2:
        raise UserError(f"{where}: a rotary width of {int(head_dim * partial)} (head_dim {head_dim} x "
                        f"partial_rotary_factor {partial}); expected at least 2")
    max_pos = r.size("max_position_embeddings", max_len)
    window, types = _window(r, layers, windowed, sliding)
    return config(
        arch=arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim,
        inter=inter, vocab=vocab, eps=eps,
        rope_theta=theta, rope_scaling=scaling, partial_rotary=partial,
        tie_embeddings=r.flag("tie_word_embeddings"),
        qkv_bias=qkv_bias, qk_norm=qk_norm,
        max_len=min(max_len, max_pos), name=name, window=window, layer_types=types,
        **({"attn_bias": r.flag("attention_bias"), "mlp_bias": r.flag("mlp_bias"), "act": LLAMA_ACTS[act]}
           if llama else {}),
    )


# Llama's hidden_act -> the step's op (transformers' ACT2FN: gelu is the exact erf form; gelu_new and
# gelu_pytorch_tanh the tanh approximation)
LLAMA_ACTS = {"silu": "silu", "gelu": "gelu_erf", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}


def _window(r, layers: int, windowed: bool, sliding) -> tuple[int, tuple[str, ...]]:
    """The window of a sliding layer (0: none) and the layers' types (none: every layer slides where the window is
    set). Mistral, Mixtral and Phi-3 slide every layer over `sliding_window` (null: none: `windowed`); the Qwen
    families only under `use_sliding_window`, the layers `layer_types` names or their default (`sliding(i, n)`)."""
    if windowed:
        return (r.size("sliding_window") if r.has("sliding_window") else 0), ()
    if sliding is None or not r.flag("use_sliding_window") or not r.has("sliding_window"):
        return 0, ()
    n = r.number("max_window_layers", 28, low=0.0, low_open=False, expected="a layer count (0 or more)")
    if not float(n).is_integer():
        raise r._bad("max_window_layers", r.c["max_window_layers"], "a layer count (0 or more)")
    types = read_layer_types(r, layers, lambda i: sliding(i, n))
    return (r.size("sliding_window"), types) if "sliding_attention" in types else (0, ())
