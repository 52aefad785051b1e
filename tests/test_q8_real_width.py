"""q8 numerics at a real model's width (hidden 576 = 18 blocks of 32, 9 heads over 3 KV heads of 64, an FFN of 1536 =
48 blocks, a tied head over 49,152 tokens — SmolLM-135M's shape) against llama.cpp, and why whole runs parted.

At a real model's width a quantized activation turns f32 ulps into flips: one q8_0 block of one activation whose max
|x| is an f32 ulp apart in two programs gets an f16 scale on the other side of a rounding point, or one value x·127/max
lands on the other side of a half, and that block's product moves by 2^-11 of itself, the next layer's activations by
~7e-5, and their quantization then turns 5, 60, 347, 3453 words... of the following layers (measured: the logits
0.10..0.22 apart for good, tokens apart at 30 layers). Every op of lanefuse's agreed with llama.cpp's to f32 rounding
(teacher-forced, <= 3e-7), and that was not enough: the ulps came from the order llama.cpp's CPU build sums in (its
vec_dot's eight lanes, llamafile's sgemm, ggml-cpu/tiled for K-quant batches of 8 rows or more), its RMS norm (a double
sum, then 1/sqrtf) and its SiLU (an expf polynomial of fused multiply-adds). Under --numerics q8 lanefuse now computes
those as llama.cpp does (engine/formats/ggml.py, checked against llama.cpp's own functions in
tests/test_ggml_order.py), its rope cache and rotation and its attention too (where llama.cpp's rope of the model
is known, engine/formats/ggml.llama_rope), and the runs equal llama.cpp's logits to the bit in every preset (measured,
bench/q8_parity.py: 0 at every step of 8 at 2 and at 30 layers; an iq4_nl head 1.9e-6 at the prompt's step, where
llama.cpp multiplies every prompt row's logits in sgemm's order). The tests: each product, norm, rope, attention and
SwiGLU on llama.cpp's own inputs (teacher-forced) equal to the bit, each preset's run equal to llama.cpp's, lanefuse's
fused plan equal to its reference under q8, and the quantization itself (llama.cpp's x86 quantize_row_q8_0) word for
word."""

from __future__ import annotations

import numpy as np
import pytest

from lanefuse.engine.formats.quantize import product, quantize
from lanefuse.kernels.q8dot import q8_exact

F32, F64 = np.float32, np.float64
REAL = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
            vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=256)


# -- llama.cpp's quantize_row_q8_0 and vec_dot_q8_0_q8_0, restated (CPU, no llama.cpp) ---------------------------------

def ggml_quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_0 as its x86 SIMD path computes it: per 32 values amax = max |x|, d = amax/127 stored
    f16, id = 127/amax (f32), q = x·id rounded to nearest (halves to even); (words (R, n) int8, f16 scales as f32)."""
    r, n = x.shape
    b = np.asarray(x, dtype=F32).reshape(r, n // 32, 32)
    amax = np.abs(b).max(axis=2)
    with np.errstate(divide="ignore"):
        idv = np.where(amax == 0, F32(0), F32(127) / amax).astype(F32)
    q = np.rint((b * idv[:, :, None]).astype(F32)).astype(np.int8)
    return q.reshape(r, n), (amax / F32(127)).astype(F32).astype(np.float16).astype(F32)


def ggml_dot_q8_0(xw, xd, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """ggml_vec_dot_q8_0_q8_0 for every row of x and of the q8_0 rows `raw`: per block the int32 sum of the words'
    products, times f32(d_x·d_w), summed block after block in f32."""
    wb = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 32, 34)
    dw = wb[:, :, :2].copy().view(np.float16)[..., 0].astype(F32)  # (n, nb)
    ww = wb[:, :, 2:].view(np.int8).astype(np.int64)  # (n, nb, 32)
    r = xw.shape[0]
    xs = xw.reshape(r, k // 32, 32).astype(np.int64)
    acc = np.zeros((r, n), dtype=F32)
    for b in range(k // 32):
        sumi = (xs[:, b, :] @ ww[:, b, :].T).astype(F32)  # exact: |sum| < 2^24
        acc = (acc + (xd[:, b:b + 1] * dw[None, :, b]).astype(F32) * sumi).astype(F32)
    return acc


def _f16_step(d16: float) -> np.float32:
    """The f32 amax whose d = f32(amax/127) rounds to f16 below the f16 halfway point after `d16` while the next f32
    above it rounds above: the two sides of one of the scale's rounding points."""
    half = np.float16(d16)
    mid = (half.astype(F64) + np.nextafter(half, np.float16(1)).astype(F64)) / 2
    a = F32(mid * 127)
    for _ in range(256):  # walk down to below the point, then up to the last f32 still below it
        if F32(a / F32(127)).astype(np.float16) == half:
            break
        a = np.nextafter(a, F32(0))
    while F32(np.nextafter(a, F32(1)) / F32(127)).astype(np.float16) == half:
        a = np.nextafter(a, F32(1))
    return a


def _activations(seed: int, rows: int, n: int) -> np.ndarray:
    """Activations as a real model's look: mostly unit scale, a few outlier channels, some exact zeros, blocks at
    an f16 rounding point of their scale."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)).astype(F32)
    x[:, rng.choice(n, 4, replace=False)] *= 60  # massive-activation channels
    x[rng.random((rows, n)) < 0.01] = 0
    x[0, :32] = 0  # an all-zero block: scale 0, words 0
    # blocks whose max/127 lies either side of an f16 rounding point of the scale
    lo = _f16_step(0.0153961181640625)
    x[1:3, 32:64] = np.clip(x[1:3, 32:64], -1, 1)
    x[1, 40], x[2, 40] = lo, np.nextafter(lo, F32(1))
    return x


@pytest.mark.parametrize("n", [576, 1536])
def test_quantize_equals_ggml_quantize_row_q8_0_at_real_width(n):
    """lanefuse's q8 quantize (engine/quantize.quantize) gives the words and f16 scales ggml's x86 quantize_row_q8_0
    gives, on real-width activations with outlier channels, zero blocks and a scale at an f16 rounding point."""
    for seed in range(4):
        x = _activations(seed, 70, n)
        q = quantize(x)
        words, scales = ggml_quantize_q8_0(x)
        assert np.array_equal(q.words, words)
        assert np.array_equal(q.d(), scales)


@pytest.mark.parametrize("n,k", [(192, 576), (1536, 576), (576, 1536), (4096, 576)])
def test_q8_product_equals_ggml_vec_dot_q8_0_at_real_width(n, k):
    """lanefuse's q8 product — the reference's (engine/quantize.product) and gemv_q8.cu's exact twin (q8dot.q8_exact)
    — of q8_0 rows at real widths (18 and 48 blocks a row, k/v rows of 3 heads of 64, a head's slab) equals ggml's
    vec_dot_q8_0_q8_0 to f32 rounding: the same int32 block sums and f16 scales, summed in another order."""
    import gguf

    rng = np.random.default_rng(k + n)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(F32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    x = _activations(n, 5, k)
    xq = quantize(x)
    want = ggml_dot_q8_0(*ggml_quantize_q8_0(x), raw, n, k)
    ref = product(xq, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))
    words, low, scales = xq.parts()
    twin = q8_exact(words, low, scales, raw.reshape(-1), "q8_0", 5, n, k)
    scale = float(np.abs(want).max())
    assert float(np.abs(ref - want).max()) <= 2e-6 * scale
    assert float(np.abs(twin - want).max()) <= 2e-6 * scale


def test_one_f16_scale_flip_is_what_parts_whole_runs():
    """Why whole runs at real size part (the module's note), pinned on numbers: two activations one f32 ulp apart
    at a block's max quantize to the same words but f16 scales one f16 ulp apart, and that block's product moves by
    2^-11 of itself — a thousand times the ulp that caused it."""
    lo = _f16_step(0.0153961181640625)  # amax and the next f32 above it: d = amax/127 rounds to f16 apart
    a = np.full((1, 32), 0.5, dtype=F32)
    a[0, 7] = lo
    b = a.copy()
    b[0, 7] = np.nextafter(lo, F32(1))
    qa, qb = quantize(a), quantize(b)
    assert np.array_equal(qa.words, qb.words)
    assert qa.d()[0, 0] != qb.d()[0, 0]
    assert abs(qb.d()[0, 0] / qa.d()[0, 0] - 1) > 2.0 ** -12
    assert np.array_equal(ggml_quantize_q8_0(a)[1], qa.d()) and np.array_equal(ggml_quantize_q8_0(b)[1], qb.d())


def test_halfway_ties_and_the_reciprocal_are_llama_cpps():
    """The two rules of llama.cpp's x86 SIMD quantize_row_q8_0 that ggml's scalar quantize_row_q8_0_ref (and gguf's
    quantizer) do not share, both lanefuse's (engine/quantize.quantize and kernels/quant.cu's quant_block): x·id =
    k + 1/2 rounds to even (_mm256_round_ps; roundf would take it away from zero: one in ~10^5 values of a real-width
    q4_0 run is a tie, ffn_norm-1's 6.5 -> 6 in llama.cpp), and id = 127/amax, not 1/d (they are an f32 ulp apart for
    some amax, and then a value whose x·id is within an ulp of a half lands on the other word)."""
    x = np.zeros((1, 32), dtype=F32)
    x[0, 0] = 127.0  # amax 127: id = 1 both ways, x·id exact
    x[0, 1:6] = [6.5, -6.5, 7.5, 0.5, -2.5]
    assert ggml_quantize_q8_0(x)[0][0, :6].tolist() == [127, 6, -6, 8, 0, -2]
    assert quantize(x).words[0, :6].tolist() == [127, 6, -6, 8, 0, -2]
    y = np.zeros((1, 32), dtype=F32)
    y[0, 0], y[0, 1] = F32(1.4099537), F32(0.016652996)  # 1/d·x = 1.5 (-> 2), 127/amax·x = 1.4999999 (-> 1)
    d = F32(y[0, 0] / F32(127))
    assert F32(F32(1) / d) != F32(F32(127) / y[0, 0]) and np.rint(F32(y[0, 1] * F32(F32(1) / d))) == 2
    assert ggml_quantize_q8_0(y)[0][0, 1] == 1 and quantize(y).words[0, 1] == 1


# -- against llama.cpp ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_file(tmp_path_factory):
    """real_file(layers, fmt): a real-width llama GGUF file (seeded weights, a smollm tokenizer), written once a
    module."""
    made = {}

    def get(layers: int, fmt: str = "q8_0"):
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
        import gguf_files as gf

        if (layers, fmt) not in made:
            model = gf.tiny_model("llama", **dict(REAL, num_hidden_layers=layers))
            _, *vocab = gf.bpe_tokenizer(REAL["vocab_size"], "smollm")
            made[layers, fmt] = gf.write_gguf(model, tmp_path_factory.mktemp("real") / f"real{layers}-{fmt}.gguf",
                                              fmt, tokenizer=vocab, pre="smollm")
        return made[layers, fmt]

    return get


def _prompt(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, REAL["vocab_size"] - 100, n)]


PRODUCTS = [  # (llama.cpp's input, its output, the weight) of each product of layer i
    ("attn_norm-{i}", "Qcur-{i}", "blk.{i}.attn_q.weight"), ("attn_norm-{i}", "Kcur-{i}", "blk.{i}.attn_k.weight"),
    ("attn_norm-{i}", "Vcur-{i}", "blk.{i}.attn_v.weight"),
    ("kqv_out-{i}", "attn_out-{i}", "blk.{i}.attn_output.weight"),
    ("ffn_norm-{i}", "ffn_gate-{i}", "blk.{i}.ffn_gate.weight"),
    ("ffn_norm-{i}", "ffn_up-{i}", "blk.{i}.ffn_up.weight"),
    ("ffn_swiglu-{i}", "ffn_out-{i}", "blk.{i}.ffn_down.weight")]


@pytest.mark.llamacpp
@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_each_op_on_llama_cpps_inputs_at_real_width(real_file, fmt):
    """Teacher-forced: a 70-token prompt (past a 64-row chunk) through a 2-layer real-width q8_0 or q4_0 model in
    llama.cpp (both read under q8 as llama.cpp reads them: activations in q8_0 blocks),
    its tensors read back; every q8 product of every layer and the tied head, computed by lanefuse (the reference's
    quantize + product, and gemv_q8.cu's exact twin over the file's bytes) on llama.cpp's own input, equals
    llama.cpp's output to the bit, and so do the RMS norms and the SwiGLU; the attention (9 heads over 3, GQA) to
    f32 rounding. Summed in another order (lanefuse's f64 sums before) the products were an ulp off on most outputs,
    the SiLU on 40% of them."""
    pytest.importorskip("llama_cpp")
    import gguf
    import llama_cpp_dump

    from lanefuse.engine.formats import ggml
    from lanefuse.engine.interp import OP_IMPL, MinRows

    rows, layers = 70, 2
    path = real_file(layers, fmt)
    d, _ = llama_cpp_dump.dump(path, _prompt(rows))
    held = {t.name: t for t in gguf.GGUFReader(path).tensors}
    worst = {}

    def check(what, got, want, tol=0.0):
        err = float(np.abs(got - want).max() / np.abs(want).max())
        worst[what.split("-")[0]] = max(worst.get(what.split("-")[0], 0.0), err)
        assert err <= tol, (what, err)

    def prod(what, x, wname, want):
        """lanefuse's products of llama.cpp's input: lanefuse's quantization of it is llama.cpp's own (ggml's x86
        quantize_row_q8_0, restated: halves to even, id = 127/amax), word for word; the reference's product (the
        interpreter's matmul over the file's rows) and the twin over the file's bytes on it equal llama.cpp's output
        to the bit (sgemm's order for a prompt's rows, vec_dot's for the head's one)."""
        t = held[wname]
        n, k, fmt, raw = int(t.shape[1]), int(t.shape[0]), t.tensor_type.name.lower(), np.asarray(t.data).reshape(-1)
        w86, s86 = ggml_quantize_q8_0(x)
        xq = quantize(x)
        assert np.array_equal(xq.words, w86) and np.array_equal(xq.d(), s86), what
        words, low, scales = xq.parts()
        rows = gguf.quants.dequantize(t.data, t.tensor_type).reshape(n, k).view(MinRows)
        rows.raw, rows.fmt = raw, fmt
        for got in (OP_IMPL["matmul"](xq, rows), q8_exact(words, low, scales, raw, fmt, x.shape[0], n, k)):
            check(what, got, want)

    def norm(x, wname):  # quantized next: llama.cpp's arithmetic (ggml_ops)
        return OP_IMPL["rmsnorm"](x, np.asarray(held[wname].data, dtype=F32), eps=REAL["rms_norm_eps"],
                                  ggml_order=True)

    for i in range(layers):
        for xn, yn, wn in PRODUCTS:
            prod(yn.format(i=i), d.first(xn.format(i=i)), wn.format(i=i), d.first(yn.format(i=i)))
        resid = d.first("embd") if i == 0 else d.last(f"l_out-{i - 1}")
        check(f"attn_norm-{i}", norm(resid, f"blk.{i}.attn_norm.weight"), d.first(f"attn_norm-{i}"))
        check(f"ffn_norm-{i}", norm(d.last(f"ffn_inp-{i}"), f"blk.{i}.ffn_norm.weight"), d.first(f"ffn_norm-{i}"))
        pre, q = d.first(f"Qcur-{i}").reshape(rows, 9, 64), d.last(f"Qcur-{i}").reshape(rows, -1)  # q roped, in the
        # file's (permuted: pairs adjacent) order; llama.cpp's rope cache and rotation restated give it to the bit
        c, sn = ggml.rope_tables(rows, 64, REAL["rope_theta"])
        y0, y1 = ggml.rope(pre[..., 0::2], pre[..., 1::2], c[:, None, :], sn[:, None, :])
        roped = np.empty_like(pre)
        roped[..., 0::2], roped[..., 1::2] = y0, y1
        check(f"Qcur-{i}", roped.reshape(rows, -1), q)
        k, v = d.last(f"Kcur-{i}").reshape(rows, -1), d.first(f"Vcur-{i}")
        att = OP_IMPL["attention"](q, k, v, np.array([0], dtype=np.int32), heads=9, kv_heads=3, hd=64, vd=64,
                                   scale=1 / 8)
        check(f"kqv_out-{i}", att, d.first(f"kqv_out-{i}"), tol=1e-6)  # summed in f64 (the module's note)
        vs = v.reshape(rows, 3, 64)  # ggml.attend, llama.cpp's order (q / k here in its own head order): to the bit
        ga = np.stack([np.concatenate([ggml.attend(q[r].reshape(9, 64)[h], k[:r + 1].reshape(-1, 3, 64)[:, h // 3],
                                                   vs[:r + 1, h // 3], 1 / 8, rows) for h in range(9)])
                       for r in range(rows)])
        check(f"kqv_out-{i}", ga, d.first(f"kqv_out-{i}"))
        glu = OP_IMPL["mul"](OP_IMPL["silu"](d.first(f"ffn_gate-{i}"), ggml_order=True), d.first(f"ffn_up-{i}"))
        check(f"ffn_swiglu-{i}", glu, d.first(f"ffn_swiglu-{i}"))
    prod("result_output", d.last("result_norm"), "token_embd.weight", d.last("result_output"))
    assert {t.tensor_type.name.lower() for t in held.values() if len(t.shape) == 2} == {fmt}
    print(f"\nlanefuse on llama.cpp's inputs ({fmt}), worst relative error by op: "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


@pytest.mark.hf
@pytest.mark.slow
def test_fused_q8_plan_equals_the_reference_at_real_width_past_a_chunk(real_file):
    """The other half of the chain (no llama.cpp): lanefuse's fused plan under q8 (exact numpy twins of the CUDA
    launches, in its arena) on a 2-layer real-width q8_0 file, a 70-token prompt prefilled in chunks of 64 and 6 and
    3 decode steps, gives the reference interpreter's logits (measured: bit-equal) — every activation quantized where
    the reference quantizes it, in the same form, so a plan that read one f32 or grouped one otherwise at this size
    parts from it at once (by a flip's 1e-3..1e-2 at least)."""
    from lanefuse.engine.front.load import load_model
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    path = real_file(2)
    prompt = _prompt(70, seed=2)
    cfg, weights = load_model(path, max_len=128)
    runners = {}

    def fused(g, env):
        if g.meta["rows"] not in runners:
            runners[g.meta["rows"]] = NumpyRunner(plan(g, numerics="q8"), weights, exact=True)
        return runners[g.meta["rows"]].step(env)

    def reference(g, env):
        return evaluate(with_numerics(g, "q8"), weights, env)

    got = generate(cfg, weights, prompt, 3, step_fn=fused, chunk=64)
    want = generate(cfg, weights, prompt, 3, step_fn=reference, chunk=64)
    rel = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, want.logits))
    print(f"\nq8 fused plan vs reference, real width, 2 layers, 70-token prompt: {rel:.1e}")
    assert got.generated_ids == want.generated_ids and rel <= 1e-6


# where lanefuse's one-layer step quantizes, and the llama.cpp tensor quantized there
QUANTIZED = [("L0.attn_norm.q8", "attn_norm-0"), ("L0.attn.q8", "kqv_out-0"), ("L0.ffn_norm.q8", "ffn_norm-0"),
             ("L0.glu.q8", "ffn_swiglu-0"), ("final_norm.q8", "result_norm")]


@pytest.mark.llamacpp
@pytest.mark.hf
@pytest.mark.slow
def test_q8_run_parts_from_llama_cpp_only_at_a_flip(real_file):
    """A whole run against llama.cpp at real width, one layer: a 70-token prompt (lanefuse: chunks of 64 and 6,
    llama.cpp: one batch) and 7 decode steps. At each step every quantized activation lanefuse reads is compared with
    llama.cpp's quantization of its own tensor there; a step where none differs has lanefuse's logits within 1e-4 of
    llama.cpp's (measured ~1e-7: a K/V row quantized apart at an earlier step reaches it only through one attention
    weight), and the run has such steps; a step where one differs may part by ~1e-2 (the module's note)."""
    pytest.importorskip("llama_cpp")
    import llama_cpp_dump

    from lanefuse.engine.front.load import load_model
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.lane.run.generate import generate

    path = real_file(1)
    prompt, n = _prompt(70, seed=2), 8
    want, steps = llama_cpp_dump.greedy_dumps(path, prompt, n)
    cfg, weights = load_model(path, max_len=128)
    seen = []

    def step(g, env):
        vals = evaluate(with_numerics(g, "q8"), weights, env)
        seen.append(vals)
        return vals

    got = generate(cfg, weights, prompt, n, step_fn=step, chunk=64)
    prefill, decode = seen[:2], seen[2:]  # the prompt's two chunks, then a step a token
    clean, rows = 0, []
    for s, ((d, want_logits), logits) in enumerate(zip(steps, got.logits)):
        mine = prefill if s == 0 else [decode[s - 1]]
        apart = []
        for lname, cname in QUANTIZED:
            words = np.concatenate([v[lname].words for v in mine])
            scales = np.concatenate([v[lname].d() for v in mine])
            w86, s86 = ggml_quantize_q8_0(d.last(cname))
            if cname == "result_norm":  # the head reads the last row only
                words, scales, w86, s86 = words[-1:], scales[-1:], w86[-1:], s86[-1:]
            if not (np.array_equal(words, w86) and np.array_equal(scales, s86)):
                apart.append(cname)
        rel = float(np.abs(logits - want_logits).max() / np.abs(want_logits).max())
        rows.append(f"{s}: {rel:.1e} {','.join(apart) or '-'}")
        if not apart:
            clean += 1
            assert rel <= 1e-4, rows
    print("\nstep: logits apart, activations quantized apart: " + "; ".join(rows))
    assert clean >= 2, rows


# -- every preset's formats at real width against llama.cpp (issue 41's done-when, at a depth the tests can afford) --

PRESETS = {  # llama.cpp's preset: (the format of rows of whole 256-value blocks, its fallback for the others)
    "Q8_0": ("q8_0", "q8_0"), "Q6_K": ("q6_k", "q8_0"), "Q5_K_M": ("q5_k", "q5_1"), "Q5_0": ("q5_0", "q5_0"),
    "Q4_K_M": ("q4_k", "q5_0"), "Q4_0": ("q4_0", "q4_0"), "Q3_K_M": ("q3_k", "q4_0"), "IQ4_NL": ("iq4_nl", "iq4_nl"),
    "IQ4_XS": ("iq4_xs", "iq4_nl"), "Q2_K": ("q2_k", "q4_0"), "Q4_1": ("q4_1", "q4_1"), "Q5_1": ("q5_1", "q5_1"),
}


@pytest.mark.llamacpp
@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_preset_at_real_width_equals_llama_cpp(preset, tmp_path):
    """A real-width llama (hidden 576 = 18 blocks of 32 and no whole number of 256-value blocks, 9 heads over 3 KV
    heads of 64, FFN 1536, tied embeddings; one layer, a 4096-token vocabulary) in each of llama.cpp's presets' formats
    — a K-quant or iq4_xs where rows are whole 256-value blocks (ffn_down), llama.cpp's fallback elsewhere — a
    12-token prompt (one chunk, as llama.cpp evaluates it in one batch: its K-quant products take ggml-cpu/tiled's
    order from 8 rows, its q8_0 / q4_0 / q5_0 / iq4_nl ones sgemm's from 2) and 4 greedy steps: lanefuse's q8 numerics
    (the reference interpreter of the q8 step graph) give llama.cpp's tokens and its logits to 1e-5 (the issue's bound
    is 0.1). Measured: 0 at every step in 10 presets, IQ4_NL / IQ4_XS 9.5e-7 / 1.4e-6 at the first (llama.cpp
    multiplies the head over every prompt row, in sgemm's order) then 0. Before lanefuse computed as llama.cpp does
    (engine/formats/ggml.py) Q8_0 was 6.2e-3 apart at the first step, Q5_0 0.10 and Q4_K_M 0.12 (a flip each: with
    the products, norms and SiLU restated but not yet the rope and attention, Q5_0 / Q4_K_M still parted by one)."""
    pytest.importorskip("llama_cpp")
    import test_formats_more_gguf as tf

    from lanefuse.engine.front.load import load_model
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.lane.run.generate import generate

    main, fallback = PRESETS[preset]
    shape = dict(REAL, vocab_size=4096, num_hidden_layers=1)
    model = tf.gf.tiny_model("llama", **shape)
    path, _, formats = tf.write(model, tmp_path / f"{preset}.gguf", lambda n, cols: main if cols % 256 == 0 else
                                fallback, tokenizer=True)
    assert set(formats.values()) == {main, fallback}
    prompt, n = _prompt(12)[:12], 4
    prompt = [t % 4000 + 50 for t in prompt]
    ll = tf.llama_cpp_apart(path, prompt, n)
    if ll is None:
        pytest.skip(f"llama.cpp (llama-cpp-python) crashed decoding the {preset} file (a signal): nothing to compare")
    want, want_logits = ll
    cfg, weights = load_model(path)
    got = generate(cfg, weights, prompt, n, chunk=len(prompt),
                   step_fn=lambda g, env: evaluate(with_numerics(g, "q8"), weights, env))
    apart = [float(np.abs(a - b).max()) for a, b in zip(got.logits, want_logits)]
    print(f"\n{preset} ({main}/{fallback}): max |logit - llama.cpp's| by step " + " ".join(f"{a:.2g}" for a in apart))
    assert got.generated_ids == want and max(apart) <= 1e-5


@pytest.mark.hf
@pytest.mark.slow
def test_q8_run_is_the_same_at_every_prefill_chunk(tmp_path):
    """Issue 41's "Q4_1 at a prefill chunk of 4" gap, traced: lanefuse's q8 step quantizes each row alone (its blocks)
    and a chunk's attention reads the earlier rows from the cache, so how a prompt is cut into chunks changes nothing
    over q4_1 rows (llama.cpp multiplies them by vec_dot at any batch; its q8_0 / q4_0 / q5_0 / iq4_nl and K-quant
    products take other orders from 2 and 8 rows, and lanefuse's under q8 with them, engine/formats/ggml.py).
    A real-width q4_1 file (q8_1's s term), a 12-token prompt in chunks of 4, 8 and 12 and 3 decode steps: the
    reference interpreter's logits equal to the bit at every step, and the fused plan's (exact twins) at chunks of 4
    and 12 equal to the bit too. (The gap measured with chunks of 4 — 2 layers, vocabulary 49,152,
    h41measure's prompt: 4.2e-6, 1.9e-6, then 0.088-0.13 from the third step — is the same at chunks of 8 and 12: one
    word of layer 1's attn_norm at the second decode step, x·127/amax -63.500015 in lanefuse and -63.499992 in
    llama.cpp, the f32 inputs 6 ulps apart from the products' summation order, the V row it makes held in the cache.)"""
    import test_formats_more_gguf as tf

    from lanefuse.engine.front.load import load_model
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.lane.run.generate import generate

    model = tf.gf.tiny_model("llama", **dict(REAL, vocab_size=4096, num_hidden_layers=1))
    path, _, formats = tf.write(model, tmp_path / "q4_1.gguf", lambda n, cols: "q4_1")
    assert set(formats.values()) == {"q4_1"}
    cfg, weights = load_model(path)
    prompt, n = [t % 4000 + 50 for t in _prompt(12, seed=3)], 3
    reference = [generate(cfg, weights, prompt, n, chunk=c, step_fn=lambda g, env: evaluate(with_numerics(g, "q8"),
                                                                                           weights, env))
                 for c in (4, 8, 12)]
    fused = [generate(cfg, weights, prompt, n, chunk=c, step_fn=tf.plan_step(weights, "q8")) for c in (4, 12)]
    for run in reference[1:] + fused:
        assert run.generated_ids == reference[0].generated_ids
        assert all(np.array_equal(a, b) for a, b in zip(run.logits, reference[0].logits))
