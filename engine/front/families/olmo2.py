"""OLMo 2 (`Olmo2ForCausalLM`): Llama's blocks (engine/front/decoder.py) in another order. No norm before the attention
or the MLP: each one's output is normed (`post_attention_layernorm`, `post_feedforward_layernorm`) before its residual
add; and q and k are each RMS-normed over the whole projection (every head's values together, a norm weight a value)
before the rotation. The rest is Llama's config and checkpoint (no GGUF file is read for it yet)."""

from __future__ import annotations

from dataclasses import dataclass

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.decoder import attention, mlp
from lanefuse.engine.front.family import Family
from lanefuse.engine.front.hfconfig import read_decoder
from lanefuse.engine.front.model import ModelConfig


@dataclass(frozen=True)
class Olmo2Config(ModelConfig):
    def weight_names(self) -> dict[str, tuple[int, ...]]:
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        w = {}
        for name, shape in super().weight_names().items():
            if not name.endswith(".input_layernorm.weight"):
                w[name] = shape
            if name.endswith(".self_attn.v_proj.weight"):
                p = name[: -len("self_attn.v_proj.weight")]
                w[p + "self_attn.q_norm.weight"] = (q,)
                w[p + "self_attn.k_norm.weight"] = (kv,)
                w[p + "post_feedforward_layernorm.weight"] = (d,)
        return w

    def layer(self, step, i: int, x: str) -> str:
        """x + norm(attention(x)), then that + norm(mlp(that)): the norms after the blocks, before the adds."""
        o = attention(step, i, x, qk_norm="whole")
        on = step.op(i, "rmsnorm", [o, step.W(i, "post_attention_layernorm.weight")], "attn_out_norm", eps=self.eps)
        x1 = step.op(i, "add", [x, on], "resid_attn")
        dn = mlp(step, i, x1)
        fn = step.op(i, "rmsnorm", [dn, step.W(i, "post_feedforward_layernorm.weight")], "ffn_out_norm", eps=self.eps)
        return step.op(i, "add", [x1, fn], "resid_ffn")


class Olmo2(Family):
    name = "olmo2"
    hf = ("Olmo2ForCausalLM",)

    @classmethod
    def read_config(cls, c, arch, where, max_len, name):
        if c.get("attention_bias"):
            raise UserError(f"{where}: attention_bias is not supported for Olmo2 (its q/k norms read the products "
                            f"unbiased)")
        return read_decoder(c, arch, where, max_len, name, config=Olmo2Config)
