"""`attention_tc`: a prompt chunk's attention on the tensor cores (attention_tc.cu), flash-attention style, under the
bf16 numerics: row r (at position pos + r) attends cache rows lo..pos + r (its last `window` when set), logits scaled
and soft-capped, per-head sinks, the output times act(gate); grouped-query heads share each tile of keys and values.
The attention launch's fields (kernels/attention.py) for a chunk of one sequence: no batch slot, splits, Split tail
or quantized output (the lane picks `attention` for those).

The numerics the twin models, exactly as the kernel computes it: a block takes one key/value head and 64 slots (slot
i: row i // group, head kvh·group + i % group) and the keys from lo of its first row to its last row's position in
tiles of 64 (TILE); q, k and v rounded to bf16; each logit l = (q̂·k̂)·scale (capped); through the tiles a running
max m_t of each slot's logits (base_t = m_t, or 0 while every logit so far is masked); p = exp(l - base_t) rounded to
f32, then bf16 (p̂); the output Σ p̂ exp(base_t - m) v̂ / Σ p̂ exp(base_t - m) (m the last m_t; sinks joined at the
end as attention.py's are). The twin computes that in f64 (`chunk_attention`); the kernel's f32 sums, expf and tanhf
differ from it by `kernel_bound`, which also allows a p̂ one bf16 step away wherever the kernel's f32 logits may round
p the other way. Against the f32 path (attention.py's exact twin) the bf16 rounding of q, k, v and p moves each
output by at most `f32_bound` (the tolerance that follows from it, stated in the tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.attention import Attends
from lanefuse.kernels.common import ACTS, MAX_GRID_Y, act, names, reach
from lanefuse.kernels.gemm_tc import bf16_round

SLOTS = 64  # a block's slots (attention_tc.cu ATC_BM)
TILE = 64  # keys a tile (ATC_BN)
THREADS = 128
MAX_D = 128  # the widest key or value head (attention_tc_128)
MIN_ROWS = 16  # the fewest chunk rows the lane sends here (knob tc_attn_rows, at least this)
U = 2.0**-8  # bf16's unit roundoff (8 significant bits, to nearest)


def dim(hd: int, vd: int) -> int:
    """The kernel's padded head: 64 for heads of at most 64 values, else 128."""
    return 64 if max(hd, vd) <= 64 else 128


@dataclass(frozen=True)
class AttentionTc(Attends):
    """out (rows, heads·vd): row r at position pos + r over cache rows lo..pos + r of kc (keys of row j at j·kstride +
    koff + kvh·hd) and vc (values at j·vstride + voff + kvh·vd), head h reading kv head h // group."""

    kstride: int = 0
    koff: int = 0
    vstride: int = 0
    voff: int = 0
    gate: tuple[str, str] | None = None
    softcap: float = 0.0

    census: ClassVar[str] = "attention_tc"
    stem: ClassVar[tuple[str, ...]] = ("gemm_tc", "attention_tc")
    tensor_cores: ClassVar[bool] = True

    @property
    def kpitch(self) -> int:
        return self.kstride or self.kv * self.hd

    @property
    def vpitch(self) -> int:
        return self.vstride or self.kv * self.vd

    def reads(self):
        return names(self.q, self.kc, self.vc, self.pos, self.sinks, self.gate[0] if self.gate else None)

    def writes(self):
        return (self.out,)

    def check(self):
        if self.group < 1 or self.heads % self.group:
            return Refusal("query heads that do not group evenly over the key/value heads")
        if not (1 <= self.hd <= MAX_D and 1 <= self.vd <= MAX_D):
            return Refusal(f"a tensor-core attention over heads of {self.hd}/{self.vd} values (keys/values: at most "
                           f"{MAX_D})")
        if self.rows < 1:
            return Refusal("an attention of no rows")
        if self.gate is not None and self.gate[1] not in ACTS:
            return Refusal(f"an attention gated by `{self.gate[1]}` (one of {', '.join(ACTS)})")
        if not self.softcap >= 0.0 or self.softcap == float("inf"):
            return Refusal(f"a soft cap of {self.softcap} on the attention's logits (a positive number, or 0: none)")
        if -(-self.rows * self.group // SLOTS) > 2**31 - 1 or self.kv > MAX_GRID_Y:
            return Refusal(f"a tensor-core attention of {self.rows} rows over {self.kv} key/value heads (too many "
                           f"blocks)")
        return None

    def extents(self, top, tokens):
        j = top + self.rows - 1
        return reach((self.q, self.rows * self.heads * self.hd), (self.pos, 1), (self.sinks, self.heads),
                     (self.kc, j * self.kpitch + self.koff + self.kv * self.hd),
                     (self.vc, j * self.vpitch + self.voff + self.kv * self.vd),
                     (self.out, self.rows * self.heads * self.vd),
                     (self.gate[0] if self.gate else None, self.rows * self.heads * self.vd))

    def weights(self):
        return {self.sinks: "f32"} if self.sinks else {}

    def span(self) -> int:
        return min(self.len, self.window) if self.window > 0 else self.len

    def bytes(self):
        blocks = -(-self.rows * self.group // SLOTS)  # each block reads its keys and values once for its slots
        keys = min(self.span(), SLOTS // self.group + self.rows) if self.window else self.len
        return 4 * (self.rows * self.heads * (self.hd + self.vd) + blocks * self.kv * keys * (self.hd + self.vd))

    def flops(self):
        return 2 * self.rows * self.heads * self.span() * (self.hd + self.vd)

    # -- the twin ----------------------------------------------------------------------------------------------------
    def operands(self, env):
        """q (rows, heads, hd), keys (cache rows, kv, hd), values (cache rows, kv, vd) as f32 views, the position,
        the sinks (or None)."""
        H, kv = self.heads, self.kv
        q = env.array(self.q)[: self.rows * H * self.hd].reshape(self.rows, H, self.hd)
        kc, vc = env.array(self.kc), env.array(self.vc)
        kp, vp = self.kpitch, self.vpitch
        nk = min(kc.size // kp, (kc.size - self.koff - kv * self.hd) // kp + 1)
        nv = min(vc.size // vp, (vc.size - self.voff - kv * self.vd) // vp + 1)
        keys = np.lib.stride_tricks.as_strided(kc[self.koff:], (nk, kv, self.hd), (kp * 4, self.hd * 4, 4))
        vals = np.lib.stride_tricks.as_strided(vc[self.voff:], (nv, kv, self.vd), (vp * 4, self.vd * 4, 4))
        sinks = env.weight(self.sinks)[0][: H].astype(np.float64) if self.sinks else None
        return q, keys, vals, env.param(self.pos), sinks

    def numpy(self, env):
        q, keys, vals, p0, sinks = self.operands(env)
        out = chunk_attention(q, keys, vals, p0, self.group, self.scale, self.window, self.softcap, sinks)
        out = out.astype(np.float32)
        if self.gate is not None:  # the kernel rounds its output to f32, then multiplies by act(gate) in f32
            gate = env.array(self.gate[0])[: out.size].reshape(out.shape).astype(np.float32)
            out = out * act(self.gate[1], gate).astype(np.float32)
        env.array(self.out)[: out.size] = out.reshape(-1)

    # -- the device ----------------------------------------------------------------------------------------------------
    def grid_block(self):
        return ((-(-self.rows * self.group // SLOTS), self.kv, 1), (THREADS, 1, 1))

    def kernel_name(self) -> str:
        return f"attention_tc_{dim(self.hd, self.vd)}"

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import NULL, f32, i64
        from lanefuse.kernels.elementwise import act_code

        g, b = self.grid_block()
        denv.function(self.stem, self.kernel_name())(g, b, (
            denv.array(self.q), denv.array(self.kc), denv.array(self.vc), denv.array(self.pos), denv.opt(self.sinks),
            denv.array(self.out), denv.array(self.gate[0]) if self.gate else NULL,
            i64(act_code(self.gate[1]) if self.gate else -1), i64(self.heads), i64(self.group), i64(self.hd),
            i64(self.vd), i64(self.rows), i64(self.window), i64(self.kpitch), i64(self.koff), i64(self.vpitch),
            i64(self.voff), f32(self.scale), f32(self.softcap)))


# -- the numerics --------------------------------------------------------------------------------------------------

def _blocks(rows: int, heads: int, group: int, p0: int, window: int):
    """Each block's slots as (rows, heads of the group) and its keys [jlo, jhi), for each key/value head's blocks."""
    slots = rows * group
    for s0 in range(0, slots, SLOTS):
        sl = np.arange(s0, min(slots, s0 + SLOTS))
        r, hh = sl // group, sl % group
        jlo = max(0, p0 + int(r[0]) - window + 1) if window > 0 else 0
        yield r, hh, jlo, p0 + int(r[-1]) + 1


def _logits(qb, kb, scale, softcap):
    lg = (qb @ kb.T) * scale
    if softcap > 0:
        lg = softcap * np.tanh(lg / softcap)
    return lg


def _mask(r, p0, window, jlo, n):
    pos = p0 + r[:, None]
    j = jlo + np.arange(n)[None, :]
    ok = j <= pos
    if window > 0:
        ok &= j > pos - window
    return ok


def _tiles(lg: np.ndarray):
    """The running max through each tile of 64 keys (-inf while all masked), the base each key's p is taken from,
    and the final max: (base (slots, keys), m (slots,))."""
    n = lg.shape[1]
    T = -(-n // TILE)
    pad = np.full((lg.shape[0], T * TILE), -np.inf)
    pad[:, :n] = lg
    run = np.maximum.accumulate(pad.reshape(lg.shape[0], T, TILE).max(axis=2), axis=1)
    base = np.where(np.isfinite(run), run, 0.0)
    return np.repeat(base, TILE, axis=1)[:, :n], run[:, -1]


def chunk_attention(q, keys, vals, p0, group, scale, window=0, softcap=0.0, sinks=None, parts=False):
    """The twin: q (rows, heads, hd), keys (len, kv, hd), values (len, kv, vd) f32 as the kernel reads them; the
    output (rows, heads, vd) in f64 of what the kernel computes (see the module's note). `parts`: also each block's
    intermediates (for the bounds): a list of (kv head, rows, heads, key range, logits, base, p̂, weights, v̂)."""
    rows, H, hd = q.shape
    kv, vd = keys.shape[1], vals.shape[2]
    qb = bf16_round(q).astype(np.float64)
    out = np.zeros((rows, H, vd))
    got = []
    top = p0 + rows  # the keys any row attends: rounded once a kv head
    for g in range(kv):
        kall = bf16_round(keys[:top, g]).astype(np.float64)
        vall = bf16_round(vals[:top, g]).astype(np.float64)
        for r, hh, jlo, jhi in _blocks(rows, H, group, p0, window):
            h = g * group + hh
            kb, vb = kall[jlo:jhi], vall[jlo:jhi]
            lg = _logits(qb[r, h], kb, scale, softcap)
            lg = np.where(_mask(r, p0, window, jlo, jhi - jlo), lg, -np.inf)
            base, m = _tiles(lg)
            with np.errstate(under="ignore"):
                p = bf16_round(np.exp(lg - base).astype(np.float32)).astype(np.float64)
                w = np.where(p > 0, p * np.exp(base - m[:, None]), 0.0)
            den = w.sum(axis=1)
            num = w @ vb
            if sinks is not None:
                big = np.maximum(m, sinks[h])
                f = np.exp(m - big)
                den = den * f + np.exp(sinks[h] - big)
                num = num * f[:, None]
            out[r, h] = num / den[:, None]
            if parts:
                got.append((g, r, h, jlo, jhi, lg, base, p, w, vb, den))
    return (out, got) if parts else out


def kernel_bound(q, keys, vals, p0, group, scale, window=0, softcap=0.0, sinks=None):
    """The most the kernel's output may differ from `chunk_attention`'s, output by output (rows, heads, vd).

    Its logits err by e_j ≤ scale·2(hd+1)·2^-24·Σ|q̂ k̂_j| (the f32 sums of the mma) + 2^-23|l_j| (the scaling) +
    2^-21·cap (tanhf), its base by at most E (the largest e of the slot's keys); exp(l - base) in f32 by 2^-22 more
    and by the rounding of l - base (2^-24 of it). So its f32 p is within θ_j of the twin's: where p(1 - θ_j) and
    p(1 + θ_j) round to the same bf16 value, p̂ is the twin's exactly, else one bf16 step (2^-7 of it) away. Each
    weight is then the twin's times 1 + ρ_j (ρ_j that step, plus 2E and the tiles' corrections), so the output
    moves by Σ ω_j ρ_j (|v̂_j| + |o|) (ω the normalized weights), and the f32 sums of p̂·v̂ and of p̂ add
    2(n + tiles + 2)·2^-24 of Σ ω|v̂| + |o|, the last divide and scale 2^-21 |o|."""
    out, got = chunk_attention(q, keys, vals, p0, group, scale, window, softcap, sinks, parts=True)
    rows, H, hd = q.shape
    bound = np.zeros_like(out)
    qa = np.abs(bf16_round(q).astype(np.float64))
    for g, r, h, jlo, jhi, lg, base, p, w, vb, den in got:
        kb = np.abs(bf16_round(keys[jlo:jhi, g]).astype(np.float64))
        fin = np.isfinite(lg)
        e = scale * 2 * (hd + 1) * 2.0**-24 * (qa[r, h] @ kb.T) + 2.0**-23 * np.where(fin, np.abs(lg), 0)
        if softcap > 0:
            e = e + 2.0**-21 * softcap
        e = np.where(fin, e, 0.0)
        E = e.max(axis=1, keepdims=True)
        T = -(-(jhi - jlo) // TILE)
        with np.errstate(invalid="ignore", under="ignore"):
            theta = e + E + 2.0**-24 * np.where(fin, np.abs(lg - base), 0) + 2.0**-22
            pe = np.where(fin, np.exp(lg - base), 0)  # the twin's p before its roundings
            lo = bf16_round((pe * (1 - theta)).astype(np.float32))
            hi = bf16_round((pe * (1 + theta)).astype(np.float32))
        flip = fin & (lo != hi)
        m = np.where(np.isfinite(lg), lg, -np.inf).max(axis=1)
        rho = np.where(flip, 2.0**-7, 0.0) + 2 * E + T * 2.0**-22 + 2.0**-24 * np.abs(base - m[:, None])
        omega = w / den[:, None]
        if sinks is not None:  # the weights' share once the sink joins (its own weight moves by 2E)
            big = np.maximum(m, sinks[h])
            omega = omega * np.exp(m - big)[:, None]
        o = np.abs(out[r, h])
        av = np.abs(vb)
        move = (omega * rho) @ av + (omega * rho).sum(axis=1)[:, None] * o
        if sinks is not None:
            sw = 1 - omega.sum(axis=1)
            move = move + (sw * 2 * E[:, 0])[:, None] * o
        n = jhi - jlo
        sums = 2 * (n + T + 2) * 2.0**-24 * (omega @ av + o)
        bound[r, h] = move / (1 - rho.max(axis=1, keepdims=True)) + sums + 2.0**-21 * o
    return bound + np.finfo(np.float32).tiny


def f32_bound(q, keys, vals, p0, group, scale, window=0, softcap=0.0, sinks=None):
    """The most the twin may differ from the exact attention of the unrounded operands (attention.py's twin), output
    by output: rounding q and k to bf16 moves each logit by at most Δ_j = scale·(2u + u²)·Σ|q k_j| (u = 2^-8; the soft
    cap only shrinks it), rounding p by a factor within 1 ± u (and its f32 step 2^-24), so each normalized weight
    moves by a factor within e^{±2A}, A = max Δ_j + u + 2^-23, and the output by at most (e^{2A} - 1)·max|v̂_j| +
    u·max|v_j| over the keys the row attends (the sinks' weights exact, their values zero)."""
    rows, H, hd = q.shape
    vd = vals.shape[2]
    bound = np.zeros((rows, H, vd))
    qa = np.abs(q.astype(np.float64))
    for g in range(keys.shape[1]):
        for r, hh, jlo, jhi in _blocks(rows, H, group, p0, window):
            h = g * group + hh
            ka = np.abs(keys[jlo:jhi, g].astype(np.float64))
            ok = _mask(r, p0, window, jlo, jhi - jlo)
            delta = np.where(ok, scale * (2 * U + U * U) * (qa[r, h] @ ka.T), 0)
            A = delta.max(axis=1) + U + 2.0**-23
            va = np.abs(vals[jlo:jhi, g].astype(np.float64))
            vmax = np.where(ok[:, :, None], va[None], 0).max(axis=1)  # (slots, vd)
            vhat = np.where(ok[:, :, None], np.abs(bf16_round(vals[jlo:jhi, g]).astype(np.float64))[None], 0).max(axis=1)
            bound[r, h] = np.expm1(2 * A)[:, None] * vhat + U * vmax
    return bound


def gate_factor(launch: AttentionTc, env) -> np.ndarray | None:
    """|act(gate)| of each output (rows, heads, vd), or None: a gated output's bounds scale by it."""
    if launch.gate is None:
        return None
    g = env.array(launch.gate[0])[: launch.rows * launch.heads * launch.vd].astype(np.float32)
    return np.abs(act(launch.gate[1], g)).reshape(launch.rows, launch.heads, launch.vd)


def blocks_a_launch(rows: int, heads: int, group: int) -> int:
    """The blocks of an attention_tc launch (the launch model's count)."""
    return -(-rows * group // SLOTS) * (heads // group)

