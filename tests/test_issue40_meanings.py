"""Issue 40's small meanings: the step's arg-max always takes the advance (fused_sampling is not held), and Llama's
attention_bias, mlp_bias and non-SiLU dense MLPs read as transformers runs them (tests/test_hf_parity.py's
llama_bias_* cases check the numbers against transformers itself)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lanefuse.engine.front.demo import demo_config
from lanefuse.engine.errors import UserError
from lanefuse.engine.front.hfconfig import config_from_hf
from lanefuse.engine.front.model import build_step
from lanefuse.lane.lower.plan import plan

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 50, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 64, "rope_theta": 10000.0, "hidden_act": "silu"}


def test_holding_fused_sampling_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"--hold fused_sampling: not held: the step's arg-max always advances"):
        plan(build_step(demo_config(), 1), held=["fused_sampling"])
    r = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", "plan", "--hold", "fused_sampling"],
                       capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "fused_sampling: not held" in r.stderr


def test_the_explorer_refuses_to_hold_fused_sampling():
    from lanefuse.lane.explore.explorer import Explorer

    ex = Explorer(build_step(demo_config(), 1), model_name="demo")
    with pytest.raises(UserError, match="hold fused_sampling: not held"):
        ex.hold("fused_sampling")
    f = plan(build_step(demo_config(), 1)).fusions  # the advance taken, as ever: alone, or with the LM head
    assert f.get("fused_sampling", 0) + f.get("head_argmax", 0) == 1 and f.get("head_argmax") == 1  # (head_argmax)
    assert plan(build_step(demo_config(), 1), held=("head_argmax",)).fusions.get("fused_sampling") == 1


@pytest.mark.parametrize("act, op", [("silu", "silu"), ("gelu", "gelu_erf"), ("gelu_pytorch_tanh", "gelu"),
                                     ("gelu_new", "gelu")])
def test_llama_biases_and_activation_are_read_into_the_step(act, op):
    cfg = config_from_hf({**LLAMA, "hidden_act": act, "attention_bias": True, "mlp_bias": True})
    assert (cfg.attn_bias, cfg.mlp_bias, cfg.act) == (True, True, op)
    names = cfg.weight_names()
    for w in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.layers.1.self_attn.{w}.bias" in names
    assert names["model.layers.0.self_attn.o_proj.bias"] == (32,)
    assert names["model.layers.0.mlp.down_proj.bias"] == (32,) and names["model.layers.0.mlp.gate_proj.bias"] == (48,)
    g = build_step(cfg, 1)
    kinds = [o.kind for o in g.ops if o.layer == 0]
    assert kinds.count(op) == 1 and kinds.count("add") == 2 + 4 + 3  # two residuals, q k v o biases, the MLP's three
    plain = config_from_hf(LLAMA)
    assert (plain.attn_bias, plain.mlp_bias, plain.act) == (False, False, "silu")
    assert "model.layers.0.self_attn.o_proj.bias" not in plain.weight_names()
