"""Expert mixtures at the front: the family of Qwen3-MoE, Mixtral and Qwen2-MoE (`Mixtures`: a dense decoder whose
layers' FFNs are expert mixtures; GGUF's `qwen3moe` / `qwen2moe`, Mixtral's is `llama`'s: families/llama.py), what a
mixture-of-experts config says (`MoeConfig`, read from config.json), the experts' weights stacked one constant a role
(`ExpertStore`: the per-expert tensors of a 4.x checkpoint or the fused 3-D ones of a 5.x checkpoint, read as the same
2-D rows) and one layer's mixture built into a step graph (its routing: engine/routing.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.family import Family
from lanefuse.engine.front.gguf_names import EXPERTS, MOE_LAYER, QK_NORM, QKV_BIAS, SHARED_EXPERT, Names
from lanefuse.engine.front.hfconfig import Reader, read_decoder

ARCHS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
SHARED_GATED = ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM")  # a shared expert scaled by sigmoid(x·gate)
# Under `use_sliding_window`, which layers slide where config.json has no `layer_types` (transformers 5.x): Qwen2-MoE
# its even layers before `max_window_layers`, Qwen3-MoE every layer (Mixtral: every layer over `sliding_window`)
SLIDING = {"Qwen2MoeForCausalLM": lambda i, n: i % 2 == 0 and i < n, "Qwen3MoeForCausalLM": lambda i, n: True}


class Mixtures(Family):
    name = "mixtures"
    hf = ARCHS
    gguf = {
        # llama.cpp renormalizes qwen3moe's chosen weights and not qwen2moe's (build_moe_ffn's norm_w), whatever the
        # checkpoint's norm_topk_prob said; `{arch}.expert_weights_norm` overrides where a file holds it
        "qwen3moe": Names("Qwen3MoeForCausalLM", {**MOE_LAYER, **QK_NORM, **EXPERTS}, moe="normed"),
        "qwen2moe": Names("Qwen2MoeForCausalLM", {**MOE_LAYER, **QKV_BIAS, **EXPERTS, **SHARED_EXPERT}, moe="plain",
                          as_row=("ffn_gate_inp_shexp.weight",)),
    }

    @classmethod
    def read_config(cls, c, arch, where, max_len, name):
        import dataclasses

        if arch == "Qwen2MoeForCausalLM" and c.get("qkv_bias") is False:
            raise UserError(f"{where}: a Qwen2-MoE without its q/k/v biases (qkv_bias false) is not supported")
        cfg = read_decoder(c, arch, where, max_len, name, windowed=arch == "MixtralForCausalLM",
                           qkv_bias=arch == "Qwen2MoeForCausalLM", qk_norm=arch == "Qwen3MoeForCausalLM",
                           sliding=SLIDING.get(arch))
        return dataclasses.replace(cfg, moe=read_moe(Reader(c, where), arch, cfg.layers))


@dataclass(frozen=True)
class MoeConfig:
    experts: int
    k: int  # experts chosen a row
    inter: int  # an expert's intermediate width (moe_intermediate_size; Mixtral's intermediate_size)
    norm_topk: bool  # the k chosen weights renormalized to sum to 1
    sparse: tuple[int, ...]  # the layers whose FFN is the mixture (the others are dense)
    shared_inter: int = 0  # Qwen2-MoE's shared expert's width (0: none), scaled by a sigmoid gate
    spelling: str = "qwen"  # where the layer's tensors live: qwen (mlp.gate, mlp.experts) | mixtral (block_sparse_moe)
    # | gptoss (mlp.router, mlp.experts' interleaved gate_up_proj: engine/front/families/gptoss.py)
    lo: int = 0  # a rank's part (expert parallelism, engine/front/parallel.py): `local` > 0 experts lo..lo+local-1
    local: int = 0  # held, the router whole; 0: every expert

    @property
    def held(self) -> int:
        """The experts whose weights a step holds: every one, or a rank's part."""
        return self.local or self.experts

    def part_attrs(self) -> dict[str, int]:
        """The `moe` op's attributes of a rank's part (none for the whole mixture)."""
        return {"lo": self.lo, "local": self.local} if self.local else {}

    # what the step and the loader ask of a config's mixture (so that neither imports this module)
    def names(self, cfg, i: int) -> dict[str, tuple[int, ...]]:
        """Layer i's mixture tensors with their shapes (`weight_names`)."""
        return weight_names(cfg, i)

    def ffn(self, cfg, i: int, h: str, op, W) -> str:
        """Layer i's mixture built into the step over its normed input `h` (`build_ffn`)."""
        return build_ffn(cfg, i, h, op, W)

    def stack(self, store, cfg, where: str):
        """`store` with the experts' tensors stacked, one constant a role (`stack_store`)."""
        return stack_store(store, cfg, where)


def read_moe(r, arch: str, layers: int) -> MoeConfig:
    """The mixture keys of config.json (`r` a hfconfig reader), as transformers 4.x and 5.x write them."""
    where = r.where
    experts = r.size("num_local_experts") if r.has("num_local_experts") else r.size("num_experts")
    k = r.size("num_experts_per_tok")
    if k > experts:
        raise UserError(f"{where}: `num_experts_per_tok` {k} is more than the {experts} experts")
    if arch == "MixtralForCausalLM":
        return MoeConfig(experts, k, r.size("intermediate_size"), True, tuple(range(layers)), spelling="mixtral")
    inter = r.size("moe_intermediate_size")
    step = r.size("decoder_sparse_step", 1)
    only = r.c.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise UserError(f"{where}: `mlp_only_layers` is {str(only)[:40]}; expected a list of layer numbers")
    sparse = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)
    shared = r.size("shared_expert_intermediate_size") if arch in SHARED_GATED else 0
    return MoeConfig(experts, k, inter, r.flag("norm_topk_prob"), sparse, shared)


# -- the weights ----------------------------------------------------------------------------------------------------

def router_name(i: int) -> str:
    return f"model.layers.{i}.mlp.gate.weight"


def gate_up_name(i: int) -> str:
    return f"model.layers.{i}.mlp.experts.gate_up_proj"


def down_name(i: int) -> str:
    return f"model.layers.{i}.mlp.experts.down_proj"


def weight_names(cfg, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's mixture tensors as the step reads them (the stacked names `ExpertStore` serves)."""
    m, d = cfg.moe, cfg.hidden
    w = {router_name(i): (m.experts, d), gate_up_name(i): (m.held * 2 * m.inter, d),
         down_name(i): (m.held * d, m.inter)}
    if m.shared_inter:
        p = f"model.layers.{i}.mlp.shared_expert."
        w[p + "gate_proj.weight"] = (m.shared_inter, d)
        w[p + "up_proj.weight"] = (m.shared_inter, d)
        w[p + "down_proj.weight"] = (d, m.shared_inter)
        w[f"model.layers.{i}.mlp.shared_expert_gate.weight"] = (1, d)
    return w


def _spellings(m: MoeConfig, i: int) -> dict[str, list[tuple[str, ...]]]:
    """Where each stacked tensor of layer i may be stored: the fused 3-D tensor (transformers 5), or per expert
    (transformers 4.x: gate_proj/up_proj/down_proj; Mixtral: w1 gate, w3 up, w2 down), each a list of names."""
    E = range(m.experts)
    if m.spelling == "mixtral":
        b = f"model.layers.{i}.block_sparse_moe."
        per = {"router": [(b + "gate.weight",)],
               "gate_up": [tuple(n for e in E for n in (f"{b}experts.{e}.w1.weight", f"{b}experts.{e}.w3.weight"))],
               "down": [tuple(f"{b}experts.{e}.w2.weight" for e in E)]}
    else:
        b = f"model.layers.{i}.mlp.experts."
        per = {"router": [],
               "gate_up": [tuple(n for e in E for n in (f"{b}{e}.gate_proj.weight", f"{b}{e}.up_proj.weight"))],
               "down": [tuple(f"{b}{e}.down_proj.weight" for e in E)]}
    fused = {"router": (router_name(i),), "gate_up": (gate_up_name(i),), "down": (down_name(i),)}
    out = {k: [fused[k]] + v for k, v in per.items()}
    # a GGUF file's (engine/front/gguf_names.py): every expert's gate rows in one tensor and their up rows in another,
    # interleaved expert by expert (`_interleaved`)
    out["gate_up"].append((f"model.layers.{i}.mlp.experts.gate_proj.stacked",
                           f"model.layers.{i}.mlp.experts.up_proj.stacked"))
    return out


def _interleaved(parts: tuple[str, ...]) -> bool:
    """Whether `parts` are the two stacked gate and up tensors (E·f rows each), to be interleaved expert by expert."""
    return len(parts) == 2 and all(p.endswith(".stacked") for p in parts)


class ExpertStore:
    """A weight store (engine/front/weights.py's backends) that also serves each mixture layer's stacked tensors: the
    router (E, d), gate_up (E·2f, d) and down (E·d, f) as 2-D rows, from a fused 3-D tensor (reshaped, no copy) or the
    per-expert tensors (stacked once, in memory). A layer holding neither names the first tensor it lacks.

    What it stacks from what is its name table (`_table`): a family whose file holds its experts otherwise serves
    them through its own table (gptoss.py's GptOssGGUFStore); a 1-D stacked tensor (the experts' biases) is
    served as f32 values."""

    def __init__(self, base, cfg, where: str):
        self.base, self.where_, self.experts = base, where, cfg.moe.experts  # where_: where() is a method
        # name -> (its parts, in order; the shape served)
        self.stacked: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = self._table(cfg, set(base.names()), where)
        self._cache: dict[str, tuple[np.ndarray, str]] = {}

    def _table(self, cfg, have: set[str], where: str) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
        """Each mixture layer's stacked tensors from the first of their spellings (`_spellings`) `have` holds."""
        stacked = {}
        for i in cfg.moe.sparse:
            shapes = weight_names(cfg, i)
            for role, names in _spellings(cfg.moe, i).items():
                name = {"router": router_name, "gate_up": gate_up_name, "down": down_name}[role](i)
                found = next((ns for ns in names if all(n in have for n in ns)), None)
                if found is None:
                    miss = next(n for ns in names[1:] or names for n in ns if n not in have)
                    raise UserError(f"{where}: the checkpoint has no tensor `{miss}` (nor the fused `{name}`): layer "
                                    f"{i}'s experts are missing")
                stacked[name] = (found, shapes[name])
        return stacked

    def _by_expert(self, parts: tuple[str, ...]) -> bool:
        """Whether `parts` are interleaved expert by expert (expert e's rows of each part in turn) or put one after
        the other."""
        return _interleaved(parts)

    def _mixed(self, name: str, parts: tuple[str, ...], fmts: set[str]) -> str:
        """The refusal of `name`'s parts stored in several formats."""
        return (f"the experts of `{name}` are stored in several formats ({', '.join(sorted(fmts))}); a mixture's "
                f"experts share one")

    def names(self) -> list[str]:
        return list(dict.fromkeys(list(self.base.names()) + list(self.stacked)))

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self.stacked:
            return self.base.info(name)
        parts, shape = self.stacked[name]
        if len(shape) == 1:  # values, decoded where read
            return shape, "f32"
        infos = [self.base.info(p) for p in parts]
        fmts = {f for _, f in infos}
        if len(fmts) > 1:
            raise UserError(f"{self.where_}: {self._mixed(name, parts, fmts)}")
        size = sum(int(np.prod(s)) for s, _ in infos)
        cols = infos[0][0][-1]
        if any(s[-1] != cols for s, _ in infos) or size != shape[0] * shape[1] or cols != shape[1]:
            got = infos[0][0] if len(parts) == 1 else f"{len(parts)} tensors of {infos[0][0]}"
            raise UserError(f"{self.where_}: tensor `{parts[0]}` has shape {got}; the config makes `{name}` "
                            f"{shape} (experts x rows, cols)")
        return shape, fmts.pop()

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        if name not in self.stacked:
            return self.base.raw(name)
        if name not in self._cache:
            parts, _ = self.stacked[name]
            shape, fmt = self.info(name)
            if len(shape) == 1:  # (E, n) values each -> expert e's from each part in turn, f32
                from lanefuse.engine.front.weights import dequantize

                vals = [(np.asarray(a, np.float32) if f == "f32" else dequantize(np.asarray(a), f)).reshape(
                    self.experts, -1) for a, f in (self.base.raw(p) for p in parts)]
                arr = np.ascontiguousarray(np.concatenate(vals, axis=1), np.float32).reshape(shape)
            elif len(parts) == 1:  # (rows, cols), or a block format's (rows, row bytes)
                arr = self.base.raw(parts[0])[0].reshape(shape[0], -1)
            else:
                arrs = [self.base.raw(p)[0] for p in parts]
                if self._by_expert(parts):  # (E, f, row) each -> expert e's gate rows then its up rows
                    arr = np.concatenate([a.reshape(self.experts, -1, a.shape[-1]) for a in arrs], axis=1)
                    arr = arr.reshape(-1, arr.shape[-1])
                else:
                    arr = np.concatenate([a.reshape(-1, a.shape[-1]) for a in arrs])
            self._cache[name] = (arr, fmt)
        return self._cache[name]

    def expert_rows(self, name: str, lo: int, hi: int) -> tuple[np.ndarray, str]:
        """Rows lo..hi-1 of `name` (a rank's experts of a stacked tensor, engine/front/parallel.py's RankStore),
        reading only the per-expert tensors that hold them (a fused tensor: its slice, memory-mapped where the store
        maps it; GGUF's interleaved pair: stacked whole, then cut)."""
        if name in self.stacked and name not in self._cache:
            parts, shape = self.stacked[name]
            if len(shape) == 2 and len(parts) > 1 and not self._by_expert(parts):
                fmt = self.info(name)[1]
                got, at = [], 0
                for p in parts:
                    n = self.base.info(p)[0][0]
                    if at < hi and at + n > lo:
                        a = self.base.raw(p)[0]
                        got.append(a.reshape(n, -1)[max(lo - at, 0):min(hi - at, n)])
                    at += n
                return np.ascontiguousarray(np.concatenate(got)), fmt
        arr, fmt = self.raw(name)
        return np.ascontiguousarray(arr[lo:hi]), fmt

    def where(self, name: str) -> str:
        parts = self.stacked.get(name)
        return self.base.where(parts[0][0] if parts else name)

    def file_name(self, name: str) -> str:
        """The name the file holds `name` under (a GGUF store's own name for it; a stacked tensor's first part)."""
        parts = self.stacked.get(name)
        inner = parts[0][0] if parts else name
        return self.base.file_name(inner) if hasattr(self.base, "file_name") else inner


def stack_store(store, cfg, where: str) -> Any:
    """`store` serving the stacked expert tensors where `cfg` has a sparse mixture, else `store` itself (gpt-oss's
    interleaved experts: engine/front/families/gptoss.py's GptOssStore, which the front picks)."""
    return ExpertStore(store, cfg, where) if cfg.moe is not None and cfg.moe.sparse else store


# -- one layer's mixture ---------------------------------------------------------------------------------------------

def build_ffn(cfg, i: int, h: str, op, W) -> str:
    """Layer i's mixture of its normed input `h` (op(kind, ins, out, **attrs) adds a layer op, W(name) declares a
    constant by its name in the layer): the `moe` op, and Qwen2-MoE's shared expert (a SwiGLU FFN) scaled by the
    sigmoid of its gate and added."""
    m = cfg.moe
    y = op("moe", [h, W("mlp.gate.weight"), W("mlp.experts.gate_up_proj"), W("mlp.experts.down_proj")], "moe",
           experts=m.experts, k=m.k, inter=m.inter, norm_topk=m.norm_topk, act="silu", routing="softmax_topk",
           **m.part_attrs())
    if not m.shared_inter:
        return y
    g = op("matmul", [h, W("mlp.shared_expert.gate_proj.weight")], "sh_gate")
    u = op("matmul", [h, W("mlp.shared_expert.up_proj.weight")], "sh_up")
    a = op("silu", [g], "sh_gate_act")
    s = op("mul", [a, u], "sh_glu")
    dn = op("matmul", [s, W("mlp.shared_expert.down_proj.weight")], "sh_down")
    sg = op("matmul", [h, W("mlp.shared_expert_gate.weight")], "sh_score")
    gate = op("sigmoid", [sg], "sh_scale")
    sh = op("mul", [dn, gate], "sh_out")
    return op("add", [y, sh], "moe_out")
