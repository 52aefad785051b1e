"""`moe`: an expert mixture in one launch — each row's router logits, its k chosen experts and their weights, the
chosen experts' gate/up products and GLU, their down products weighed and summed; optionally a shared expert scaled by
the sigmoid of its gate (shared_expert_fusion), a chunk's rows grouped by expert so each chosen expert's weights are
read once (`sort`, moe_token_sort), and the residual add and the next RMSNorm of the sum (moe_deferred_finalize).
Under the q8 numerics (`qwords`: shared_expert_fusion.quant) the shared expert's gate and up products (and its gate
score's, with `qgate`) read the input quantized to int8 blocks of 32 and its down product its GLU quantized, as the
separate Quant and GEMV launches would: the kernels quantize the input row into shared memory as they read it and the
GLU in the up kernel's epilogue (scratch `squant`), and multiply by gemv_q8.cu's int8 block sums. Over K-quant rows
(`qwords` 3) both are llama.cpp's q8_K form (blocks of 256, gemv_q8.cu's q8k_tile), the GLU quantized whole by each
block of the down kernels into its shared memory (a block of 256 spans four of the up kernel's tiles); the finalize
writes the next norm's q8k form too (`quant_words` 3).
The experts are stacked one constant a role (engine/front/families/mixtures.py): gate_up (E·2f, d), down (E·d, f);
a rank's part of a mixture (`lo`, `local`: expert parallelism, engine/front/parallel.py) holds its experts' rows
alone, every row routed over all E, the choices of other ranks' experts adding nothing (the ranks' parts sum to it).

The CUDA side (moe.cu) is two kernels for a row at a time (moe_up: every block routes its row and computes its tile of
one choice's hidden values; moe_down: the weighed down products, the shared expert, and the finalize by the last block
of a row to arrive; with `router_split` > 1, moe_up_split in moe_up's place: each row's router logits and choice
computed once, by `router_split` blocks, as phase 0 of the launch, the choices' blocks taking later tickets and waiting
on it, as kernels/chain.cu orders its phases), four over sorted rows (moe_route, moe_up_sorted and moe_down_sorted a
block an expert over the rows that chose it, moe_finish a block a row). gpt-oss's mixture (router and expert biases, top-k then softmax, the
clamped GLU) runs in the same kernels, its biases and clamp passed as arguments; so does DeepSeek-V3's grouped sigmoid
routing (moe_choose's `grouped` branch: the correction bias in the choice alone, the groups kept, the routed scale),
routed by moe_up a row at a time and by moe_route over sorted rows (a prefill chunk's moe_token_sort.grouped; one
twin for both forms: the same choices, weights and sums; tests/test_deepseek_sorted_chunk.py)."""

from __future__ import annotations

import weakref

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.formats import ggml
from lanefuse.engine.routing import route
from lanefuse.engine.formats.quantize import Quantized, quantize
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import (ACTS, FORMAT_CODE, FORMATS, Q8K, Dst, Launch, Scratch, act, decode,
                                     format_refusal, names, quant_layout, reach, rms, weight_bytes)
from lanefuse.kernels.gemv import products, q8_check
from lanefuse.kernels.norm import quantized_next
from lanefuse.kernels.q8dot import q8_exact
from lanefuse.kernels.quant import QuantEpilogue, quant_check

MAX_EXPERTS = 4096  # router logits held in a block's shared memory (moe.cu MOE_MAXE)
MAX_K = 32  # experts chosen a row
WARPS = 8  # warps a block (moe.cu MOE_WARPS)
TILE = 64  # hidden (or output) values a block (moe.cu MOE_TILE)
ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_group")  # topk_softmax (gpt-oss): the k largest logits, then
# their softmax; sigmoid_group (DeepSeek-V3): sigmoid scores, `br` the correction bias of the choice, chosen in groups
MOE_ACTS = ACTS + ("clamped_glu",)  # the kernel's act codes (moe.cu: act_apply's, then MOE_CLAMPED 4)
MAX_GROUPS = 64  # expert groups (moe.cu MOE_MAXG)
MAX_QUANT_ROW = 8192  # a shared expert's quantized input row in a block's shared memory (moe.cu MOE_MAXQ)


_ROUTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # env -> {router name: its rows in f64}


def router64(env, name: str, experts: int, d: int) -> np.ndarray:
    """A router's rows (experts, d) in f64, made once an env."""
    made = _ROUTERS.setdefault(env, {})
    if name not in made:
        made[name] = np.asarray(env.matrix(name), dtype=np.float64).reshape(experts, d)
    return made[name]


@dataclass(frozen=True)
class Moe(QuantEpilogue, Launch):
    x: str  # (rows, d) the normed input
    wr: str  # router rows (E, d)
    wgu: str  # experts' gate and up rows (E·2f, d): expert e's gate at e·2f, its up at e·2f + f
    wd: str  # experts' down rows (E·d, f)
    out: Dst  # (rows, d): the mixture, or with `nw` the norm of add + mixture
    d: int
    f: int
    experts: int
    k: int
    rows: int
    format: str  # the experts' format (gate_up and down)
    format_r: str = "f32"  # the router's
    format_d: str | None = None  # the down rows' where they differ from gate_up's (llama.cpp's Q4_K_M: q6_k)
    norm_topk: bool = False
    act: str = "silu"
    routing: str = "softmax_topk"
    sort: bool = False  # rows grouped by expert (moe_token_sort)
    sg: str | None = None  # the shared expert's gate, up (sf, d) and down (d, sf) rows and its gate score row (1, d)
    su: str | None = None
    sd: str | None = None
    sgate: str | None = None
    sf: int = 0
    format_s: str | None = None  # the shared expert's gate rows' format: the kernel reads its up and down rows in it
    format_su: str | None = None  # the others' formats where the lane says them (refused unless format_s; the gate
    # score row's may differ)
    format_sd: str | None = None
    format_sgate: str | None = None
    add: str | None = None  # the residual added to the mixture (into `out`, or with `nw` into `sum`),
    sum: str | None = None  # finalize: the sum written here
    nw: str | None = None  # and normed by this weight into `out`
    eps: float = 0.0
    br: str | None = None  # gpt-oss: the router's bias (E,), the experts' gate/up biases (E·2f,) and down biases
    bgu: str | None = None  # (E·d,), f32 values
    bd: str | None = None
    limit: float = 0.0  # act clamped_glu: the clamp (gate above, up both ways) and the sigmoid's slope
    alpha: float = 1.702
    groups: int = 1  # sigmoid_group: the experts in `groups` groups, the `topk_groups` best kept, the weights
    topk_groups: int = 1  # times `route_scale`
    route_scale: float = 1.0
    qwords: int = 0  # > 0 (the q8 numerics): the shared expert's products read the input and its GLU quantized to
    qgate: bool = False  # that many int8 words a value; with qgate its gate score's product too
    quant: str | None = None  # with `nw`: the norm's quantized form, written in the finalize's epilogue (the q8
    quant_words: int = 0  # numerics: moe_deferred_finalize's .quant rules), that many int8 words a value (3: the q8k
    # form, llama.cpp's q8_K, for K-quant rows)
    stage: int | None = None  # one of the kernels the launch makes (`kernels()`: its share of the bytes and flops)
    per_warp: int = 1  # a row at a time: the experts' values a warp at once (4: moe.cu moe_dots; the same bits)
    lo: int = 0  # a rank's part (expert parallelism: engine/front/parallel.py): `local` > 0 experts lo..lo+local-1
    local: int = 0  # held (wgu, wd, bgu, bd theirs alone), each row routed over all E, only those held summed
    router_split: int = 1  # a row at a time: > 1, each row's router logits computed once by that many blocks and its
    # choice by the last of them, phase 0 of the launch (moe.cu moe_up_split); 1, by every block of moe_up

    census: ClassVar[str] = "moe"
    words_field: ClassVar[str] = "quant_words"  # the finalized norm's form (`qwords`: the shared expert's input)
    stem: ClassVar[tuple[str, ...]] = ("quant", "gemv_core", "gemv_q8", "moe")
    steps: ClassVar[tuple[str, ...]] = ("rows_a_warp", "router_split")

    def __post_init__(self):
        # a flag that came through the e-graph, which holds booleans as 0 / 1
        for name, default in (("limit", 0.0), ("alpha", 1.702), ("groups", 1), ("topk_groups", 1),
                              ("route_scale", 1.0), ("qwords", 0), ("quant_words", 0),
                              ("lo", 0), ("local", 0),
                              ("router_split", 1)):  # an optional variable its rule did not bind
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        for name in ("norm_topk", "sort", "qgate"):
            v = getattr(self, name)
            if v in (0, 1, None) and not isinstance(v, bool):
                object.__setattr__(self, name, bool(v))

    @property
    def shared(self) -> bool:
        return self.sg is not None

    @property
    def held(self) -> int:
        """The experts whose weights the launch holds: all E, or a rank's part (`local`)."""
        return self.local or self.experts

    def mine(self, e: int) -> int:
        """Global expert e's slot among those held, or -1 (another rank's)."""
        e -= self.lo
        return e if 0 <= e < self.held else -1

    @property
    def _fsg(self) -> str:
        """The shared expert's gate score row's format."""
        return self.format_sgate or self.format_s or self.format

    @property
    def width(self) -> int:
        """Hidden values a choice's row holds in scratch: the widest of the experts and the shared expert."""
        return max(self.f, self.sf)

    def reads(self):
        return names(self.x, self.wr, self.wgu, self.wd, self.br, self.bgu, self.bd, self.sg, self.su, self.sd, self.sgate, self.add, self.nw,
                     *self.out.params())

    def writes(self):
        return names(self.out.buf, self.sum, self.quant)

    def check(self):
        if self.per_warp not in (1, 4):
            return Refusal(f"an expert mixture {self.per_warp} values a warp (the kernels take 1 or 4)")
        why = self.split_refusal(self.router_split)
        if why:
            return why
        if self.local < 0 or self.lo < 0 or self.lo + self.held > self.experts:
            return Refusal(f"a part of an expert mixture of experts {self.lo}..{self.lo + self.held - 1} of "
                           f"{self.experts}")
        if self.routing not in ROUTINGS:
            return Refusal(f"an expert mixture routed by `{self.routing}` (the kernel takes {' or '.join(ROUTINGS)})")
        if self.routing != "sigmoid_group" and (self.groups, self.topk_groups, self.route_scale) != (1, 1, 1.0):
            return Refusal(f"expert groups or a routing scale under `{self.routing}` routing (sigmoid_group's)")
        g, t = self.groups, self.topk_groups
        if g < 1 or self.experts % g or not 1 <= t <= g or g > MAX_GROUPS or (g > 1 and self.experts // g < 2) \
                or t * (self.experts // g) < self.k:
            return Refusal(f"the top {self.k} of {t} of {g} expert groups over {self.experts} experts (the kernel "
                           f"takes at most {MAX_GROUPS} groups of at least 2, enough experts in those kept)")
        gptoss = self.routing == "topk_softmax" or self.act == "clamped_glu"
        if gptoss and (self.br is None or self.bgu is None or self.bd is None or not self.limit > 0):
            return Refusal("a gpt-oss mixture without its router and expert biases and its GLU clamp (this launch "
                           "does not carry them)")
        if gptoss and self.shared:
            return Refusal("a gpt-oss mixture with a shared expert (not linked yet)")
        for fmt, cols, what in ((self.format_r, self.d, "the mixture's router"),
                                (self.format, self.d, "the mixture's gate/up rows"),
                                (self.format_d or self.format, self.f, "the mixture's down rows")):
            why = format_refusal(fmt, cols, what)
            if why:
                return why
        if self.act not in MOE_ACTS:
            return Refusal(f"an expert activation `{self.act}`")
        if not 1 <= self.k <= min(MAX_K, self.experts) or self.experts > MAX_EXPERTS:
            return Refusal(f"top-{self.k} of {self.experts} experts (the kernel keeps at most {MAX_K} of at most "
                           f"{MAX_EXPERTS})")
        if self.shared and (self.su is None or self.sd is None or self.sf < 1 or self.format_s not in FORMATS):
            return Refusal("a shared expert without its gate, up and down rows")
        if self.shared:
            why = format_refusal(self.format_s, self.d, "the shared expert") or \
                format_refusal(self.format_s, self.sf, "the shared expert's down rows") or \
                format_refusal(self._fsg, self.d, "the shared expert's gate score")
            if why:
                return why
        other = {f for f in (self.format_su, self.format_sd) if f is not None}
        if self.shared and other - {self.format_s}:
            return Refusal(f"a shared expert whose rows are in several formats "
                           f"({', '.join(sorted(other | {self.format_s}))}): the kernel reads them in one")
        if self.qwords and not self.shared:
            return Refusal("a mixture whose shared expert reads quantized activations, with no shared expert")
        if self.qwords:
            why = quant_check(self.d, self.qwords, "a shared expert's quantized input row", k_form=True) or \
                quant_check(self.sf, self.qwords, "a shared expert's quantized GLU row", k_form=True) or \
                q8_check(self.qwords, self.format_s, self.d, 1) or q8_check(self.qwords, self.format_s, self.sf, 1) or \
                (q8_check(self.qwords, self._fsg, self.d, 1) if self.qgate and self.sgate is not None else None)
            if why:
                return why
            if self.d > MAX_QUANT_ROW:
                return Refusal(f"a shared expert's quantized input row of {self.d} values (the kernel holds at most "
                               f"{MAX_QUANT_ROW} in shared memory)")
            if self.qwords == Q8K and self.sf > MAX_QUANT_ROW:  # the down kernels quantize the GLU row themselves
                return Refusal(f"a shared expert's GLU row of {self.sf} values quantized as q8k (the down kernels hold "
                               f"at most {MAX_QUANT_ROW} in shared memory)")
        if self.quant is not None and self.nw is None:
            return Refusal("a mixture quantizing its result without the norm it finalizes (the quantized form is the "
                           "norm's)")
        if self.quant is not None:
            why = self.epilogue_refusal(self.d, "a mixture's normed row")
            if why:
                return why
            if self.quant_words == Q8K and (self.out.row is not None or not self.out.contiguous):
                return Refusal("a mixture's normed row quantized as q8k (blocks of 256) not stored whole in its own "
                               "buffer (the finalize reads each block back from the stored row)")
        if self.nw is not None and (self.add is None or self.sum is None):
            return Refusal("a mixture normed without the residual it is added to and the sum it writes")
        return None

    def tune(self, knobs, held=frozenset()):
        """`rows_a_warp` (seed 002's Moe `per_warp`): a row at a time (moe_up, moe_down: the decode step's mixture),
        four of a warp's values at once (its loads of four weight rows in flight where it had one) once a tile gives
        every warp four (the experts' and the model's widths at least 4 x WARPS); held, sorted rows, or narrower: one.
        No byte or launch changes: the latency of a warp's dependent loads does."""
        four = "rows_a_warp" not in held and not self.sort and min(self.f, self.d) >= 4 * WARPS
        tuned = replace(self, per_warp=4 if four else 1)
        return replace(tuned, router_split=tuned.split_for(held))

    def router_rounds(self) -> int:
        """The rounds of router dots a warp makes where one block computes a row's E logits (moe_up: WARPS warps,
        `per_warp` logits each at once)."""
        return -(-self.experts // (WARPS * self.per_warp))

    def split_for(self, held=frozenset()) -> int:
        """`router_split` (seed 002's Moe `router_split`): a row at a time, moe_up's every block computes the row's
        E router logits (E x d products, `router_rounds` rounds of a warp's dots) before its tile of one choice's
        hidden values: the same sums in each of the row's k x tiles blocks. Split, the row's logits are
        computed once, by `router_rounds` blocks of one round each (each block's warps one logit or four), and its
        choice by the last of them; the choices' blocks wait on that (a poll where the kernel had the rounds). Taken
        where a block routing whole makes more than one round (that is what the split removes from every block's
        path; at one round it would add a poll and save none); 1 where held, over sorted rows (moe_route routes in a
        launch of its own), or where the kernel refuses it."""
        n = self.router_rounds()
        if "router_split" in held or n < 2:
            return 1
        return n if self.split_refusal(n) is None else 1

    def split_refusal(self, n: int) -> Refusal | None:
        """Why the routing cannot be split in n (one line), or None."""
        if n < 1:
            return Refusal(f"an expert mixture's routing split in {n} blocks")
        if n == 1:
            return None
        if self.sort:
            return Refusal("a mixture over sorted rows with its routing split (moe_route routes each row in a launch "
                           "of its own: router_split 1)")
        if n > self.experts:
            return Refusal(f"a mixture's routing of {self.experts} experts split in {n} blocks (at most one a logit)")
        return None

    # -- what it touches and costs ------------------------------------------------------------------------------
    def scratch(self):
        rk, h = self.rows * self.k, self.rows * (self.k + 1) * self.width
        s = [Scratch("choices", "i32", 4 * rk), Scratch("weights", "f32", 4 * rk + 4 * self.rows),
             Scratch("hidden", "f32", 4 * h)]
        if self.sort:
            s.append(Scratch("parts", "f32", 4 * self.rows * (self.k + 1) * self.d))
        elif self.nw is not None:
            s.append(Scratch("arrivals", "i32", 4 * self.rows, counter=True))
        if self.router_split > 1:  # phase 0's logits (rows, E); the tickets, the arrivals past phase 0, each row's
            # router arrivals, each row's flag (moe.cu moe_up_split)
            s += [Scratch("logits", "f32", 4 * self.rows * self.experts),
                  Scratch("routed", "i32", 4 * (2 + 2 * self.rows), counter=True)]
        if self.qwords in (1, 2):  # the shared expert's GLU quantized (kernels/quant.py's layout), for its down product
            # (the q8k form's: in the down kernels' shared memory)
            s.append(Scratch("squant", "u8", quant_layout(self.rows * self.sf, self.qwords)[2]))
        return tuple(s)

    def kernels(self):
        """Its kernels, each costed by its share: a row at a time moe_up, moe_down; over sorted rows moe_route,
        moe_up_sorted, moe_down_sorted, moe_finish."""
        return tuple(replace(self, stage=i) for i in range(4 if self.sort else 2))

    def extents(self, top, tokens):
        n, E, H = self.rows * self.d, self.experts, self.held
        return reach((self.x, n), (self.wr, E * self.d), (self.wgu, H * 2 * self.f * self.d),
                     (self.wd, H * self.d * self.f), (self.br, E), (self.bgu, H * 2 * self.f),
                     (self.bd, H * self.d), (self.sg, self.sf * self.d), (self.su, self.sf * self.d),
                     (self.sd, self.d * self.sf), (self.sgate, self.d), (self.add, n), (self.sum, n),
                     (self.nw, self.d), (self.out.buf, self.out.extent(n, top)), (self.quant, n))

    def weights(self):
        # the experts first: a plan's bytes by format (Plan.weight_bytes) names a launch's by its first weight's
        w = {self.wgu: self.format, self.wd: self.format_d or self.format, self.wr: self.format_r}
        if self.shared:
            w.update({self.sg: self.format_s, self.su: self.format_s, self.sd: self.format_s})
            if self.sgate is not None:
                w[self.sgate] = self._fsg
        if self.nw is not None:
            w[self.nw] = "f32"
        for b in (self.br, self.bgu, self.bd):
            if b is not None:
                w[b] = "f32"
        return w

    def chosen(self) -> int:
        """Expert weights read at most: each row's k choices, or over sorted rows each expert once; a rank's part
        its share of the choices (falling evenly on the experts: an expectation, rounded up), over sorted rows at most
        each of its experts once (a row at a time, a row's choices each read again: a chunk's part is not capped)."""
        if self.local:
            n = -(-self.rows * self.k * self.held // self.experts)
            return min(self.held, n) if self.sort else n
        return min(self.experts, self.rows * self.k) if self.sort else self.rows * self.k

    def checkpoint_bytes(self):
        """The router's rows, the chosen experts' gate/up and down rows, the shared expert's: in their formats."""
        f, d, fd = self.f, self.d, self.format_d or self.format
        b = weight_bytes(self.format_r, self.experts, d) + self.chosen() * (weight_bytes(self.format, 2 * f, d)
                                                                            + weight_bytes(fd, d, f))
        if self.shared:
            fs = self.format_s
            b += weight_bytes(fs, 2 * self.sf, d) + weight_bytes(fs, d, self.sf) + \
                (weight_bytes(self._fsg, 1, d) if self.sgate is not None else 0)
        return b

    def _shares(self) -> list[tuple[int, int]]:
        """(bytes, flops) of each kernel, in order."""
        f, d, R, fd, fs = self.f, self.d, self.rows, self.format_d or self.format, self.format_s
        n, hidden = R * d, 4 * R * (self.k + self.shared) * self.width
        router = (weight_bytes(self.format_r, self.experts, d) + 4 * n, 2 * R * self.experts * d)
        up = (self.chosen() * weight_bytes(self.format, 2 * f, d) + 4 * n + hidden
              + (weight_bytes(fs, 2 * self.sf, d) + (weight_bytes(self._fsg, 1, d) if self.sgate is not None else 0)
                 if self.shared else 0),
              2 * R * (self.k * 2 * f * d + (2 * self.sf + 1) * d * self.shared))
        down = (self.chosen() * weight_bytes(fd, d, f) + hidden + (weight_bytes(fs, d, self.sf) if self.shared else 0),
                2 * R * (self.k * f * d + self.sf * d * self.shared))
        tail = 4 * (n + (n if self.add else 0) + (n if self.sum else 0) + (d if self.nw else 0)) + \
            self.epilogue_bytes(n)
        if not self.sort:  # moe_up routes each row itself; moe_down sums and finalizes
            return [(router[0] + up[0], router[1] + up[1]), (down[0] + tail, down[1])]
        parts = 4 * R * (self.k + 1) * d
        return [router, up, (down[0] + parts, down[1]), (parts + tail, 2 * R * (self.k + 1) * d)]

    def bytes(self):
        shares = self._shares()
        return sum(b for b, _ in shares) if self.stage is None else shares[self.stage][0]

    def flops(self):
        shares = self._shares()
        return sum(f for _, f in shares) if self.stage is None else shares[self.stage][1]

    # -- the twins ------------------------------------------------------------------------------------------------
    def _route(self, env, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raw, fmt = env.weight(self.wr)
        logits = products(x, decode(raw, fmt).reshape(self.experts, self.d), 1)  # (rows, E) f32
        if self.routing == "sigmoid_group":
            return self._grouped(env, logits)
        if self.br is not None:
            logits = (logits + self._bias(env, self.br)).astype(np.float32)
        chosen, w = route(logits, self.k, bool(self.norm_topk), self.routing)
        return chosen, w.astype(np.float32)

    def _grouped(self, env, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """sigmoid_group's choices and weights, the correction bias `br` in the choice alone."""
        bias = None if self.br is None else self._bias(env, self.br)
        chosen, w = route(logits, self.k, bool(self.norm_topk), self.routing, bias, self.groups, self.topk_groups,
                          self.route_scale)
        return chosen, w.astype(np.float32)

    def _bias(self, env, name: str | None, n: int | None = None) -> np.ndarray:
        """A bias's f32 values, (n,) (zeros where the mixture has none)."""
        if name is None:
            return np.zeros(n, dtype=np.float32)
        return np.asarray(env.weight(name)[0], dtype=np.float32).reshape(-1)

    def _glu(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        """The experts' GLU in f32: act(g)·u, or gpt-oss's clamped (min(u, l)... ) form."""
        if self.act != "clamped_glu":
            return (act(self.act, g).astype(np.float32) * u).astype(np.float32)
        from lanefuse.engine.interp import clamped_glu

        return clamped_glu(np.asarray(g, np.float64), np.asarray(u, np.float64), self.limit,
                           self.alpha).astype(np.float32)

    def _finish(self, env, y: np.ndarray) -> None:
        """y (rows, d) f32: the mixture (plus the residual `add`) into `out`, or with `nw` that sum kept in `sum` and
        its norm into `out`."""
        if self.add is not None:
            y = (env.array(self.add)[: y.size].reshape(y.shape) + y).astype(np.float32)
        if self.nw is None:
            self.out.write(env, y)
            return
        s = y
        env.array(self.sum)[: s.size] = s.reshape(-1)
        if self.quant is not None and self.quant_words in ggml.WORDS or quantized_next(env, self.out.buf):
            # quantized to llama.cpp's form (here or by a Quant launch, `fuse_quant` held): normed as llama.cpp norms
            normed = ggml.rmsnorm(s, np.asarray(env.weight(self.nw)[0], dtype=np.float32)[: self.d], self.eps)
        else:
            w = np.asarray(env.weight(self.nw)[0], dtype=np.float64)[: self.d]
            normed = (s * rms(s, self.eps) * w).astype(np.float32)
        self.out.write(env, normed)
        self.epilogue_write(env, normed)  # from the f32 values stored, as the last block reads them back

    def numpy(self, env):
        """As the kernels sum: each product's dot in f64 rounded to f32, the GLU in f32, the chosen experts' down
        products weighed and summed in choice order in f32, the shared expert's scaled product last."""
        x = env.array(self.x)[: self.rows * self.d].reshape(self.rows, self.d).astype(np.float32)
        self._finish(env, self._mixture(env, x))

    def _mixture(self, env, x: np.ndarray) -> np.ndarray:
        """The exact twin's mixture of x (rows, d) f32, before the residual add and the norm: (rows, d) f32."""
        d, f, k = self.d, self.f, self.k
        chosen, w = self._route(env, x)
        H = self.held
        raw, fmt = env.weight(self.wgu)
        gu = decode(raw, fmt).reshape(H, 2 * f, d)
        raw, fmt = env.weight(self.wd)
        dn = decode(raw, fmt).reshape(H, d, f)
        bgu = self._bias(env, self.bgu, H * 2 * f).reshape(H, 2 * f)
        bd = self._bias(env, self.bd, H * d).reshape(H, d)
        y = np.zeros((self.rows, d), dtype=np.float32)
        for r in range(self.rows):
            for c in range(k):
                e = self.mine(int(chosen[r, c]))
                if e < 0:  # another rank's expert
                    continue
                g = (products(x[r:r + 1], gu[e, :f], 1) + bgu[e, :f]).astype(np.float32)
                u = (products(x[r:r + 1], gu[e, f:], 1) + bgu[e, f:]).astype(np.float32)
                h = self._glu(g, u)
                o = (products(h, dn[e], 1)[0] + bd[e]).astype(np.float32)
                y[r] = (y[r] + w[r, c] * o).astype(np.float32)
        if self.shared:
            y = (y + self._shared(env, x, exact=True)).astype(np.float32)
        return y

    def _shared(self, env, x: np.ndarray, exact: bool) -> np.ndarray:
        """The shared expert's output scaled by the sigmoid of its gate score (unscaled without one: DeepSeek's),
        (rows, d) f32."""
        sf, d = self.sf, self.d

        def m(name: str, n: int, kk: int) -> np.ndarray:
            if not exact:
                return env.matrix(name).reshape(n, kk)
            raw, fmt = env.weight(name)
            return decode(raw, fmt).reshape(n, kk)

        prod = (lambda a, b: products(a, b, 1)) if exact else (lambda a, b: (a @ b.T).astype(np.float32))
        def qprod(a: np.ndarray, name: str, n: int, kk: int, quantized: bool) -> np.ndarray:
            """a · wᵀ, or under `qwords` the product of a quantized to int8 blocks (gemv_q8's block sums; the fast
            twin: the blocks dequantized, f32 BLAS), as a Quant launch and a GEMV would compute it."""
            if not (self.qwords and quantized):
                return prod(a, m(name, n, kk))
            q: Quantized = quantize(a, self.qwords)
            if not exact:
                return (q.values().astype(np.float32) @ m(name, n, kk).T).astype(np.float32)
            raw, fmt = env.weight(name)
            words, low, scales = q.parts()  # low: q8x2's low words, the q8k form's sums of 16 words, or None
            return q8_exact(words, low, scales, raw, fmt, a.shape[0], n, kk)

        g, u = qprod(x, self.sg, sf, d, True), qprod(x, self.su, sf, d, True)
        if self.act == "silu" and self.qwords in ggml.WORDS:  # a GLU of products of llama.cpp's form: its SiLU
            h = ggml.swiglu(g, u)
        else:
            h = (act(self.act, g).astype(np.float32) * u).astype(np.float32)
        down = qprod(h, self.sd, d, sf, True)
        if self.sgate is None:
            return down.astype(np.float32)
        score = act("sigmoid", qprod(x, self.sgate, 1, d, bool(self.qgate))).astype(np.float32)  # (rows, 1)
        return (down * score).astype(np.float32)

    def fast(self, env):
        """In f32 BLAS on the stacks decoded once: the rows that chose each expert gathered into one product (as
        the sorted kernels group them, whatever `sort` says: the same sums within f32 rounding)."""
        d, f = self.d, self.f
        x = env.array(self.x)[: self.rows * d].reshape(self.rows, d)
        # the router's logits as the exact twin's (f64 dots rounded to f32): an f32 BLAS dot an ulp apart would
        # choose the other of two experts whose logits tie within it
        logits = (x.astype(np.float64) @ router64(env, self.wr, self.experts, d).T).astype(np.float32)
        if self.routing == "sigmoid_group":
            chosen, w = self._grouped(env, logits)
        else:
            chosen, w = route(logits + self._bias(env, self.br, self.experts), self.k, bool(self.norm_topk),
                              self.routing)
        H = self.held
        bgu = self._bias(env, self.bgu, H * 2 * f).reshape(H, 2 * f)
        bd = self._bias(env, self.bd, H * d).reshape(H, d)
        gu = env.matrix(self.wgu).reshape(H, 2 * f, d)
        dn = env.matrix(self.wd).reshape(H, d, f)
        y = np.zeros((self.rows, d), dtype=np.float32)
        for g in np.unique(chosen):
            rows, cs = np.nonzero(chosen == g)  # a row chooses an expert once: `rows` are distinct
            e = self.mine(int(g))
            if e < 0:  # another rank's expert
                continue
            if len(rows) == 1:  # a GEMV each (np.dot: BLAS gemv on the stored rows)
                a = np.dot(gu[e], x[rows[0]])[None, :]  # (1, 2f)
            else:
                a = x[rows] @ gu[e].T  # (n, 2f)
            a = a + bgu[e]
            h = self._glu(a[:, :f], a[:, f:])
            out = (np.dot(dn[e], h[0])[None, :] if len(rows) == 1 else h @ dn[e].T) + bd[e]
            y[rows] += out * w[rows, cs][:, None].astype(np.float32)
        if self.shared:
            y += self._shared(env, np.asarray(x, dtype=np.float32), exact=False)
        if not (y.max() < np.inf and y.min() > -np.inf):  # NaN fails both: an f32 product overflowed, or x holds it
            y = self._mixture(env, np.asarray(x, dtype=np.float32))  # as the exact twin (and the reference) have it
        self._finish(env, y)

    # -- the device ---------------------------------------------------------------------------------------------
    def _squant(self, denv, a) -> tuple:
        """The shared expert's quantized GLU in its scratch: words, low words, scales (null pointers without)."""
        from lanefuse.kernels.cupy_env import NULL

        if a is None:
            return NULL, NULL, NULL
        n = self.rows * self.sf
        lo, sc, _ = quant_layout(n, self.qwords)
        low = a[lo:lo + n].view(denv.cp.int8) if self.qwords == 2 else NULL
        return a[:n].view(denv.cp.int8), low, a[sc:sc + 4 * (n // 32)].view(denv.cp.float32)

    def grid_block(self):
        """moe_up's grid: (tiles, k + shared, rows), or with `router_split` its blocks in one dimension, the router's
        first (moe_up_split: a block's ticket says its work)."""
        tiles = -(-self.width // TILE)
        if self.router_split > 1:
            return ((self.rows * (self.router_split + tiles * (self.k + self.shared)), 1, 1), (32 * WARPS, 1, 1))
        return ((tiles, self.k + self.shared, self.rows), (32 * WARPS, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import NULL, f32, i64

        sc = {s.tag: denv.scratch(self, s) for s in self.scratch()}
        block = (32 * WARPS, 1, 1)
        fs = FORMAT_CODE[self.format_s or self.format]
        common = (denv.array(self.x), i64(self.rows), i64(self.d), i64(self.f), i64(self.experts), i64(self.k),
                  i64(FORMAT_CODE[self.format]), i64(FORMAT_CODE[self.format_d or self.format]),
                  i64(MOE_ACTS.index(self.act)), sc["choices"], sc["weights"],
                  sc["hidden"], denv.opt(self.bgu), denv.opt(self.bd), f32(self.limit), f32(self.alpha),
                  i64(1 if self.sort else self.per_warp), i64(self.lo), i64(self.held))
        shared = (denv.opt(self.sg), denv.opt(self.su), denv.opt(self.sd), denv.opt(self.sgate), i64(self.sf),
                  i64(fs), i64(FORMAT_CODE[self._fsg]), i64(self.qwords), i64(int(bool(self.qgate))),
                  *self._squant(denv, sc.get("squant")))
        grouped = self.routing == "sigmoid_group"
        route = (denv.weight(self.wr)[0], i64(FORMAT_CODE[self.format_r]), i64(int(bool(self.norm_topk))),
                 denv.opt(self.br), i64(int(self.routing == "topk_softmax")), i64(int(grouped)), i64(self.groups),
                 i64(self.topk_groups), f32(self.route_scale))
        fin = (denv.opt(self.add), denv.opt(self.sum), denv.opt(self.nw), f32(self.eps), *denv.dst(self.out),
               *self.epilogue_args(denv))
        up_tiles, down_tiles = -(-self.width // TILE), -(-self.d // TILE)
        wgu, wd = denv.weight(self.wgu)[0], denv.weight(self.wd)[0]
        calls = []  # (kernel, grid, arguments) in order; a stage (kernels()) launches its own alone
        if not self.sort:
            if self.router_split > 1:
                calls.append(("moe_up_split", self.grid_block()[0], common + route + (wgu,) + shared
                              + (sc["logits"], sc["routed"], i64(self.router_split))))
            else:
                calls.append(("moe_up", (up_tiles, self.k + self.shared, self.rows), common + route + (wgu,) + shared))
            calls.append(("moe_down", (down_tiles, self.rows, 1),
                          common + (wd,) + shared + (sc.get("arrivals", NULL),) + fin))
        else:
            calls += [("moe_route", (self.rows, 1, 1), common + route + shared),
                      ("moe_up_sorted", (up_tiles, self.held + self.shared, 1), common + (wgu,) + shared),
                      ("moe_down_sorted", (down_tiles, self.held + self.shared, 1),
                       common + (wd,) + shared + (sc["parts"],)),
                      ("moe_finish", (self.rows, 1, 1), common + shared + (sc["parts"],) + fin)]
        for i, (name, grid, args) in enumerate(calls):
            if self.stage is None or self.stage == i:
                denv.function(self.stem, name)(grid, block, args)
