"""DeepSeek-V3 figures, in one run: the whole plan() of a DeepSeek-V3-shaped decode step (61 layers, 256 routed
experts top-8 in 8 groups of which 4 are kept, 1 shared expert, 3 dense layers, latent attention; shape only: no
weights) beside the dense Qwen3-8B shape's; launches per decode layer (the census of a dense and of a mixture layer);
the KV-cache bytes per token per layer: the latent cache (the normed latent and the rotated key part) against an
expanded cache of the same model (each head's key and value); and for a prefill chunk, the latent attention's
launches and the cost model's estimate of one layer's, absorbed against expanded (the lane entry's `expand_rows`).

    python bench/deepseek_figures.py [--repeat 3] [--json FILE] [--sort | --expand]

--sort prints only a prefill chunk's mixtures sorted by expert against a row at a time (sort_figures: PREDICTIONS of
the lane's cost model), 8 to 256 rows. --expand prints only a chunk's latent attention, its expansions priced by the
lane against bench/launch_model.py's wave model and bench/gemm_model.py's tensor-core product (expand_figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from lanefuse.engine.front.hfconfig import config_from_hf
from lanefuse.engine.front.model import build_step
from lanefuse.engine.rules import load_table
from lanefuse.lane.lower.plan import plan
from qnext_figures import timed_plan

# DeepSeek-V3's config.json keys (the released model's values; its YaRN as 4.x wrote it)
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
               "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "norm_topk_prob": True, "vocab_size": 129280,
               "max_position_embeddings": 163840, "rope_theta": 10000,
               "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}


def bf16(cfg):
    return dataclasses.replace(cfg, formats=tuple((n, "bf16") for n, s in cfg.weight_names().items() if len(s) == 2))


def deepseek_v3(layers: int = 61):
    return bf16(config_from_hf({**DEEPSEEK_V3, "num_hidden_layers": layers}, "DeepSeek-V3 shape", max_len=4096,
                               name=f"deepseek-v3-shape-{layers}L"))


def qwen3_8b(layers: int = 36):
    from lanefuse.engine.front.model import ModelConfig

    return bf16(ModelConfig("Qwen3ForCausalLM", 4096, layers, 32, 8, 128, 12288, 151936, qk_norm=True,
                            rope_theta=1e6, max_len=4096, name=f"qwen3-8b-shape-{layers}L"))


def kv_bytes(cfg) -> dict[str, int]:
    """f32 bytes a token's cache rows take in one layer: the latent cache (what the step carries) and an expanded
    cache of the same model (each head's rotated-and-unrotated key and its value, as a GQA cache would hold them)."""
    latent = 4 * sum(cfg.cache_widths)
    expanded = 4 * cfg.heads * (cfg.nope + cfg.head_dim + cfg.v_dim)
    return {"latent": latent, "expanded": expanded}


def chunk_figures(table, rows: int = 64, layers: int = 5) -> dict:
    """One mixture layer in a chunk of `rows` rows (a 4096-row cache): its launches and the cost model's estimate
    under the cuda lane (`expand_rows` 64: the latent attention absorbed) and under a user lane expanding chunks of
    more than 16 rows (extraction then takes the expanded mla or, where that costs more, the attention's parts)."""
    import tempfile
    from pathlib import Path

    g = build_step(deepseek_v3(layers), rows)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "lanes").mkdir()
        (Path(d) / "lanes" / "expanding.yaml").write_text(
            "lane: expanding\nbase: cuda\nwhy: chunks of more than 16 rows expanded\nclasses:\n"
            "  mla: {support: native, hook: latent, fields: {expand_rows: 16}}\n")
        for name, kw in (("cuda", {}), ("expanding", dict(lane="expanding", rules_dirs=(d,)))):
            s = plan(g, table=table, **kw)
            mine = [l for l in s.launches if l.layer == layers - 1]
            out[name] = {"launches": sorted(l.launch.census for l in mine),
                         "mla": [l.launch.census for l in mine if l.cls == "mla"],
                         "cost_us": round(sum(l.cost_us for l in mine), 1)}
            print(f"  a mixture layer in a chunk of {rows} rows, lane {name} (cost model estimate, 4096-row cache): "
                  f"{out[name]['cost_us']:,.1f} us; mla {', '.join(out[name]['mla']) or 'not chosen'}; "
                  f"{len(mine)} launches")
    return out


def head_gemv_prediction(hg, filled: int) -> dict:
    """bench/launch_model.py's wave model (time_us, the GEMV family's Little's law) of one HeadGemv launch over
    `filled` rows of x: a warp an output of rows_a_warp() rows (head_gemv: 1, 16 blocks of 4 warps a SM at 32
    registers; head_gemv_rows: 8, 9 blocks at 56), one bf16 value of w a lane in flight (64 B: PTX one load of w an
    iteration), ceil(a / 32) dependent rounds. Every warp's rows re-read the heads' matrices: the first pass from HBM
    (the calibration's L_us round, B_peak), the later ones from L2 (they fit: 16 MiB of 60 MB) at its L_l2_us round,
    capped at bench/gemm_model.py's L2_TBPS (an assumption). A PREDICTION: no device has run head_gemv."""
    import dataclasses as dc
    import math

    from gemm_model import L2_TBPS
    from launch_model import Call, Kernel, load_calibration, time_us
    from lanefuse.kernels.head_gemv import RESIDENT_BLOCKS, RESIDENT_BLOCKS_ROWS

    cal = load_calibration()
    l2 = dict(cal, L_us=cal["L_l2_us"], B_peak_TBps=L2_TBPS)
    wbytes = hg.checkpoint_bytes()
    rw = dc.replace(hg, m=filled).rows_a_warp()
    us, parts = 0.0, []
    first = min(rw, filled)
    for rows, c in ((first, cal), (filled - first, l2)):
        if rows <= 0:
            continue
        one = dc.replace(hg, m=rows, upto=None, extra=0)
        grid = (-(-(-(-rows // rw)) * hg.heads * hg.b // 4), 1, 1)  # the filled rows' kernel's grid (rw rows a warp)
        k = Kernel(0, "head_gemv", one, Call(("head_gemv",), "head_gemv", grid, (128, 1, 1), ()),
                   bpsm=RESIDENT_BLOCKS if rw == 1 else RESIDENT_BLOCKS_ROWS,
                   family="gemv", bytes=float(-(-rows // rw) * wbytes), inflight_warp=32 * 2.0,
                   rounds=float(math.ceil(hg.a / 32)), extra={"fmt": "bf16", "loop": "head_gemv x1"})
        t = time_us(k, c)
        us += t - (cal["t0_us"] if parts else 0.0)  # one launch: its fixed cost once
        parts.append(round(t, 1))
    streamed = -(-filled // rw) * wbytes
    return {"us": round(us, 1), "streamed_gb": round(streamed / 1e9, 2), "tbps": round(streamed / (us * 1e-6) / 1e12, 2),
            "rows_a_warp": rw}


def expand_figures(table, chunks=(64, 128, 512, 2048), positions=(0, 4096), layers: int = 4) -> dict:
    """A prefill chunk's latent attention at DeepSeek-V3's shape (issue 35 H5): for each chunk and position, each
    expanded half (HeadGemv, 512 -> 128 heads x 128, over the filled cache rows pos + rows) as the lane priced it at
    d7e3618 (the weights read once, the flops at tflops_f32, over the plan's cache rows L), as it prices it now
    (HeadGemv.rate: the loop's rounds) over the filled rows and over L, bench/launch_model.py's wave model of the
    kernel as written (head_gemv_prediction), and bench/gemm_model.py's tensor-core product of the same (gemm_tc: x
    (filled, 512) by w (16384, 512)); the absorbed form's output expansion (HeadGemv over the chunk's rows) the same
    ways; and which form the plan takes at each width (lane cuda, a cache of `max_len` rows). Every time a
    PREDICTION."""
    import dataclasses as dc

    from gemm_model import gemm_prediction
    from lanefuse.kernels.common import Dst
    from lanefuse.kernels.head_gemv import HeadGemv
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.shim import kind_cost, launch_us

    knobs, costs = Knobs(), table_costs()
    cfg = deepseek_v3(layers)
    h, nope, vd, lora, L = cfg.heads, cfg.nope, cfg.v_dim, cfg.kv_lora, cfg.max_len
    half = HeadGemv("lc", "wk", "bf16", Dst("kx"), L, 1, lora, h * nope, rows_out=True, upto="pos")

    def old_us(hg):  # the price before HeadGemv.rate: the gap, the kind's fixed time, max(bytes, flops at f32)
        c = kind_cost(hg, costs)
        return knobs.launch_us + c.fixed_us + max(hg.bytes() / (knobs.hbm_gbps * c.bandwidth * 1e3),
                                                  hg.flops() / (knobs.tflops_f32 * 1e6))

    out = {"cache_rows": L, "rows": {}}
    print(f"DeepSeek-V3 shape, one layer's latent attention in a prefill chunk (bf16 rows; kv_b {lora} x {h} x "
          f"({nope} + {vd}) = {2 * half.checkpoint_bytes() / 2 ** 20:.0f} MiB; the plan's cache {L} rows). "
          f"PREDICTIONS, no device:")
    print(f"  an expanded half (key or value, {lora} -> {h} x {nope}), over the filled rows pos + rows:")
    print(f"  {'rows':>5} {'pos':>5} {'filled':>6} | {'priced d7e3618':>14} {'priced now':>10} | "
          f"{'wave model':>10} {'L2 TB/s':>7} {'GB':>7} | {'old/model':>9} {'now/model':>9} | {'gemm_tc':>8}")
    for rows in chunks:
        row = {}
        for pos in positions:
            f = pos + rows
            at = dc.replace(half, m=f, upto=None)
            pred = head_gemv_prediction(half, f)
            old, now = old_us(half), launch_us(at, knobs, costs)  # d7e3618 priced the plan's L rows, f unknown
            tc = gemm_prediction(f, h * nope, lora, half.checkpoint_bytes())
            row[pos] = {"filled": f, "priced_before_us": round(old, 1), "priced_now_us": round(now, 1),
                        "priced_now_at_L_us": round(launch_us(half, knobs, costs), 1), "model": pred,
                        "gemm_tc_us": tc["us"]}
            print(f"  {rows:5d} {pos:5d} {f:6d} | {old:14,.1f} {now:10,.1f} | {pred['us']:10,.1f} "
                  f"{pred['tbps']:7.2f} {pred['streamed_gb']:7.1f} | {old / pred['us']:9.3f} "
                  f"{now / pred['us']:9.3f} | {tc['us']:8,.1f}")
        absorbed = HeadGemv("a", "wv", "bf16", Dst("y"), rows, h, lora, vd, rows_out=True)
        row["absorbed_expansion"] = {"priced_before_us": round(old_us(absorbed), 1),
                                     "priced_now_us": round(launch_us(absorbed, knobs, costs), 1),
                                     "model": head_gemv_prediction(absorbed, rows)}
        out["rows"][rows] = row
    print("  the absorbed form's output expansion (128 heads, 512 -> 128 each, over the chunk's rows):")
    for rows in chunks:
        a = out["rows"][rows]["absorbed_expansion"]
        print(f"  {rows:5d} rows: priced d7e3618 {a['priced_before_us']:,.1f} us, now {a['priced_now_us']:,.1f} us; "
              f"wave model {a['model']['us']:,.1f} us ({a['priced_now_us'] / a['model']['us']:.3f})")
    print(f"  the plan's latent attention (lane cuda, a {layers}-layer step, the layer {layers - 1}; the expanded halves "
          f"priced over the cache's {L} rows, {launch_us(half, knobs, costs):,.1f} us each as head_gemv):")
    for tc in (0, 16):
        for rows in chunks:
            s = plan(build_step(cfg, rows), table=table, knobs=dc.replace(knobs, tc_rows=tc))
            mine = [l for l in s.launches if l.layer == layers - 1]
            mla = [l for l in mine if l.cls == "mla"]
            form = "expanded" if any(l.launch.census != "head_gemv" and l.launch.census != "attention" or
                                     getattr(l.launch, "upto", None) for l in mla) else "absorbed"
            kinds = [f"{l.launch.census} {l.cost_us:,.1f}" for l in mine
                     if l.cls == "mla" or l.launch.census in ("attention", "head_gemv")]
            layer = sum(l.cost_us for l in mine)
            out["rows"][rows][f"plan_tc_rows_{tc}"] = {"form": form, "launches": kinds, "layer_us": round(layer, 1)}
            print(f"  tc_rows {tc:2d}, {rows:5d} rows: {form}; {'; '.join(kinds)} us; the layer {layer:,.1f} us")
    return out


def table_costs():
    from lanefuse.lane.lower.table import load_lane

    return load_lane("cuda").costs


SORT_RULES = ["moe_token_sort.grouped", "moe_token_sort.grouped_plain"]


def sort_figures(table, rows_list=(8, 16, 32, 64, 128, 256), layers: int = 5) -> dict:
    """A prefill chunk's mixtures (5 layers: 2 mixture layers) under the cuda lane's cost model, the rows sorted by
    expert (moe_token_sort.grouped: moe_route, moe_up_sorted, moe_down_sorted, moe_finish; each chosen expert's
    weights read once a chunk) against the same chunk with the sort rules held (a row at a time: moe_up, moe_down;
    each row's 8 choices read): the Moe launches' estimate, the expert weights they read, and what the plan chooses.
    PREDICTIONS of the lane's cost model (rules/lanes/cuda.yaml's costs), not measurements."""
    out = {}
    cfg = deepseek_v3(layers)
    for rows in rows_list:
        g = build_step(cfg, rows)
        row = {}
        for name, held in (("chosen", []), ("per_row", SORT_RULES)):
            s = plan(g, table=table, held=held)
            moes = [l for l in s.launches if l.launch.census == "moe"]
            row[name] = {"sorted": sum(bool(l.launch.sort) for l in moes), "mixtures": len(moes),
                         "cost_us": round(sum(l.cost_us for l in moes), 1),
                         "experts_read": sum(l.launch.chosen() for l in moes),
                         "bytes_mb": round(sum(l.launch.bytes() for l in moes) / 1e6, 1)}
        a, b = row["chosen"], row["per_row"]
        print(f"  chunk of {rows:3d} rows: mixtures sorted {a['sorted']} of {a['mixtures']}; Moe launches "
              f"{a['cost_us']:,.1f} us ({a['experts_read']} experts read, {a['bytes_mb']:,.1f} MB) against per row "
              f"{b['cost_us']:,.1f} us ({b['experts_read']} read, {b['bytes_mb']:,.1f} MB): "
              f"{b['cost_us'] / a['cost_us']:.2f}x (PREDICTION)")
        out[rows] = row
    return out


def q8_figures(table, layers: int = 6) -> dict:
    """A 6-layer DeepSeek-V3 decode step on q8_0 and on q4_k rows (every product's rows of whole blocks) under
    --numerics q8 beside f32: launches a step and a mixture layer, and the Quant launches left (the goal: none, every
    quantize in its producer's epilogue, so the same launches as f32)."""
    out = {}
    base = deepseek_v3(layers)
    runs = [("bf16", "f32", base)]
    consts = build_step(base, 1).constants
    for fmt in ("q8_0", "q4_k"):  # q4_k: the products read llama.cpp's q8_K form (blocks of 256)
        bl = 32 if fmt == "q8_0" else 256
        rows = [n for n, k in consts.items() if k.kind == "rows" and k.shape[-1] % bl == 0]
        runs.append((fmt, "q8", dataclasses.replace(base, formats=tuple((n, fmt) for n in rows))))
    for fmt, numerics, cfg in runs:
        s = plan(build_step(cfg, 1), table=table, numerics=numerics)
        one = [i for i in range(1, cfg.layers) if cfg.sparse(i)][1]
        per = s.per_layer()[one]
        out[f"{numerics} {fmt}"] = {"launches": s.n_launches, "moe_layer": per, "quant": s.census.get("quant", 0)}
        print(f"  {cfg.layers}-layer step, {fmt} rows, --numerics {numerics}: {s.n_launches} launches "
              f"({s.census.get('quant', 0)} Quant); a mixture layer {per}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="plan() runs a shape (median)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--sort", action="store_true", help="only the sorted chunks' figures")
    ap.add_argument("--expand", action="store_true", help="only the latent attention's expansions in a chunk")
    args = ap.parse_args()
    table = load_table()
    out = {}
    if args.expand:
        out["expand"] = expand_figures(table)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    if args.sort:
        print("DeepSeek-V3 shape (5 layers, bf16), a prefill chunk's two mixtures: sorted by expert or a row at a time "
              "(PREDICTIONS of the cuda lane's cost model, no device)")
        out["sort"] = sort_figures(table)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    print(f"whole plan() of a decode step (engine + link + schedule + arena), median of {args.repeat}")
    for name, cfg in (("deepseek-v3", deepseek_v3()), ("qwen3-8b", qwen3_8b())):
        sec, s, least = timed_plan(cfg, table, args.repeat)
        layers = s.per_layer()
        wb = sum(s.weight_bytes().values())
        row = {"plan_s": round(sec, 4), "plan_min_s": round(least, 4), "engine_s": round(s.timings["engine_s"], 4), "launches": s.n_launches,
               "census": s.census, "weight_bytes": wb}
        print(f"  {name:12s} {cfg.layers} layers: {sec:.3f} s (least {least:.3f} s; engine {s.timings['engine_s']:.3f} s); "
              f"{s.n_launches} launches; weights read {wb / 1e6:,.1f} MB")
        if cfg.moe is not None:
            dense = [layers[i] for i in range(1, cfg.layers) if not cfg.sparse(i)]
            sparse = [layers[i] for i in range(1, cfg.layers - 1) if cfg.sparse(i)]
            row.update(dense_layer=max(dense), moe_layer=max(sparse))
            one = [i for i in range(1, cfg.layers) if cfg.sparse(i)][1]  # a mixture layer after a mixture layer: the
            # Moe launch that norms a layer's input counts in that layer
            kinds = sorted(k.census for l in s.launches if l.layer == one for k in l.launch.kernels())
            print(f"  {'':12s} launches a layer: dense {max(dense)}, mixture {max(sparse)} (goal 7); layer {one}: "
                  f"{', '.join(kinds)}")
            kv = kv_bytes(cfg)
            row["kv_bytes_per_token_layer"] = kv
            print(f"  {'':12s} KV cache a token a layer (f32): latent {kv['latent']:,} B "
                  f"({cfg.kv_lora} + {cfg.head_dim} values) against expanded {kv['expanded']:,} B "
                  f"({cfg.heads} heads of {cfg.nope + cfg.head_dim} + {cfg.v_dim}): "
                  f"{kv['expanded'] / kv['latent']:.1f}x smaller")
        else:
            body = [v for k, v in layers.items() if 0 < k < cfg.layers - 1]
            row["per_layer"] = max(body)
            kv = 4 * 2 * cfg.kv_heads * cfg.head_dim
            row["kv_bytes_per_token_layer"] = kv
            print(f"  {'':12s} launches a layer: {max(body)}; KV cache a token a layer (f32): {kv:,} B")
        out[name] = row
    out["chunk"] = chunk_figures(table)
    out["q8"] = q8_figures(table)
    out["sort"] = sort_figures(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
