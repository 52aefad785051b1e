"""Per-rank census goldens (issue 38): each rank's decode plan for the cuda lane at R = 2, its census {launch kind:
count} and one middle layer's launches in order (census kind, the rule that made each), for a Qwen3 (dense), a
Qwen2-MoE (its sigmoid-gated shared expert) and a Qwen3-Next (its gated attention and gated delta-net layers, each
with a mixture) decode step. Reviewed by eye; a refactor shows no diff. What they pin: a rank's mixture takes its part
of the shared expert inside its Moe launches (shared_expert_fusion over the rank's experts), then the one all-reduce a
layer's FFN, which takes the residual add and the next norm (all_reduce_add_norm); both ranks plan the same launches.
The one rank's plans are other goldens' (tests/test_lane.py, test_engine.py: the chained layers change with
kernels/chain.*); a failure here prints the one rank's census beside the rank's to compare (at 342d7da: Qwen3 chain 3
+ fold 5, a layer one chain and the next q/k/v fold; Qwen2-MoE a layer moe_deferred_finalize.shared's Moe, the q/k/v
fold, the attention, the o fold with its add and norm)."""

from __future__ import annotations

import pytest

from lanefuse.engine.front.families.mixtures import MoeConfig
from lanefuse.engine.front.model import ModelConfig
from lanefuse.engine.front.parallel import build_rank_step
from ranks_helpers import rule_table

AR = ("collective", "all_reduce_add_norm")


def _qwen3() -> ModelConfig:
    """3 layers of 48, 4 heads over 2 KV heads of 8, an FFN of 64, a vocabulary of 101."""
    return ModelConfig("Qwen3ForCausalLM", 48, 3, 4, 2, 8, 64, 101, qk_norm=True, max_len=24)


def _qwen2_moe() -> ModelConfig:
    """As _qwen3 with q/k/v biases, every layer a mixture of 6 experts of 24 (top 2) with a shared expert of 32."""
    m = MoeConfig(experts=6, k=2, inter=24, norm_topk=False, sparse=(0, 1, 2), shared_inter=32)
    return ModelConfig("Qwen2MoeForCausalLM", 48, 3, 4, 2, 8, 64, 101, qkv_bias=True, max_len=24, moe=m)


def _qwen3_next():
    """tests/test_ranks_qnext.py's tiny Qwen3-Next (delta, attention, delta, delta; layers 1 and 3 mixtures with a
    shared expert)."""
    from test_ranks_qnext import _cfg

    return _cfg()


# model: (layer, a rank's census, its layer's launches)
GOLDEN = {
    "qwen3": (1, {"attention": 3, "collective": 7, "fold": 4, "gemv": 7, "gemv_glu": 3},
              [AR, ("fold", "merged_qkv"), ("attention", None), ("gemv", None), AR, ("gemv_glu", "gemv_gate_up_glu"),
               ("gemv", None)]),
    "qwen2-moe": (1, {"attention": 3, "collective": 7, "fold": 4, "gemv": 4, "moe": 6},
                  [AR, ("fold", "merged_qkv"), ("attention", None), ("gemv", None), AR,
                   ("moe", "shared_expert_fusion")]),
    "qwen3-next": (3, {"attention": 1, "collective": 9, "conv_parts": 3, "delta": 3, "fold": 1, "gates": 3,
                       "gemm_parts": 4, "gemv": 7, "gemv_glu": 2, "moe": 4, "rope_parts": 1},
                   [AR, ("gemm_parts", "merged_qkv"), ("conv_parts", "conv_parts"), ("gates", "gdn_gating"),
                    ("delta", None), ("gemv", None), AR, ("moe", "shared_expert_fusion"), AR]),
}
CONFIGS = {"qwen3": _qwen3, "qwen2-moe": _qwen2_moe, "qwen3-next": _qwen3_next}


def _census(cfg, rank: int, ranks: int, layer: int):
    from lanefuse.lane.lower.plan import plan

    p = plan(build_rank_step(cfg, rank, ranks, 1), table=rule_table())
    return dict(p.census), [(x.launch.census, x.rule) for x in p.launches if x.layer == layer], p


@pytest.mark.parametrize("model", list(GOLDEN))
def test_rank_census_golden(model):
    """Each of 2 ranks' decode census and layer (the same on both)."""
    cfg = CONFIGS[model]()
    layer, two, two_layer = GOLDEN[model]
    for r in range(2):
        census, launches, p = _census(cfg, r, 2, layer)
        if (census, launches) != (two, two_layer):
            one, one_layer, _ = _census(cfg, 0, 1, layer)
            print(f"one rank: {one}\n  layer {layer}: {one_layer}\nrank {r}: {census}\n  layer {layer}: {launches}")
        assert (census, launches) == (two, two_layer), f"rank {r}"
        # collectives: two all-reduces a layer (the o product's, the FFN's or the mixture's with its shared expert's
        # part), each with the residual add and the next norm, and the arg-max over the ranks
        assert census["collective"] == 2 * cfg.layers + 1


@pytest.mark.parametrize("model", ["qwen2-moe", "qwen3-next"])
def test_a_ranks_mixture_holds_its_shared_experts_part(model):
    """Each mixture's Moe launch of a rank holds its experts (lo, local) and its cut of the shared expert (sf: half of
    the shared expert's width at R = 2): the shared expert runs inside the mixture's launches, none beside them."""
    from lanefuse.kernels import Moe

    cfg = CONFIGS[model]()
    for r in range(2):
        *_, p = _census(cfg, r, 2, 0)
        moes = [x.launch for x in p.launches if isinstance(x.launch, Moe)]
        lo = 3 * r  # 6 experts, 3 a rank
        assert moes and all((m.lo, m.local, m.shared, m.sf) == (lo, 3, True, cfg.moe.shared_inter // 2)
                            for m in moes)
