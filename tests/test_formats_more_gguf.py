"""GGUF files in the block formats llama.cpp's presets write beyond q8_0 / q4_0 / q4_k / q6_k — q4_1, q5_0, q5_1,
q5_k, q3_k, q2_k, iq4_nl, iq4_xs — and a file mixing them as llama.cpp's quantizer mixes them (Q4_K_M on a width no
multiple of 256 writes q5_0 beside q4_k, q6_k, q8_0): a tiny Llama written in each, loaded by the front, run by the
reference interpreter and by the fused plan (numpy backend, exact twins), against transformers on the file's weights
decoded by gguf.quants.dequantize: the same greedy tokens, logits within 1e-4 of their scale. Under --numerics q8 the
plan equals the interpreter of the q8 step graph, each product reading the activation form llama.cpp pairs with its
rows (q8_K for the K-quants and iq4_xs, q8_0's words and scale for the others), and llama.cpp where llama-cpp-python
is installed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import gguf_files as gf  # noqa: E402
from hf_ref import fused_step, hf_greedy, scaled_error  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from lanefuse.engine.interp import evaluate  # noqa: E402
from lanefuse.engine.formats.quantize import K_FORMATS, with_numerics  # noqa: E402
from lanefuse.engine.formats.blocks import BLOCKS, encode  # noqa: E402
from lanefuse.lane.lower.plan import plan  # noqa: E402
from lanefuse.lane.run.generate import generate  # noqa: E402
from lanefuse.lane.run.numpy_runner import NumpyRunner  # noqa: E402

pytestmark = pytest.mark.hf

NEW = ["q4_1", "q5_0", "q5_1", "q5_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs"]
PROMPT = [3, 17, 5, 42, 8, 11]
N = 10
TOL = 1e-4
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=400, rope_theta=500.0, rms_norm_eps=1e-5)
WIDE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, vocab_size=400)
# llama.cpp's own type names, for the writer
GGML = {f: gguf.GGMLQuantizationType[f.upper()] for f in list(BLOCKS) if f != "mxfp4"}


def stored(values: np.ndarray, fmt: str) -> np.ndarray:
    """f32 rows as the bytes a `fmt` tensor holds (f32 as itself)."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    return v if fmt == "f32" else encode(v, fmt)


def decoded(values: np.ndarray, fmt: str) -> np.ndarray:
    v = np.asarray(values, np.float32)
    return v if fmt == "f32" else gguf.quants.dequantize(encode(v, fmt), GGML[fmt]).astype(np.float32)


def write(model, path, fmt_of, tokenizer: bool = False) -> tuple:
    """`model` (a transformers Llama) as a GGUF file, each 2-D tensor in the format fmt_of(hf name, cols) gives (as
    llama.cpp's converter names and permutes them; with a BPE tokenizer in its metadata where asked: llama.cpp loads
    no file without one); and a copy of the model holding the file's weights decoded."""
    import copy

    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), "llama")
    gf.add_shape_keys(w, path, cfg, heads, kv, hd, hd)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(hd)
    w.add_file_type(15)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer:
        _, *vocab = gf.bpe_tokenizer(cfg.vocab_size, "qwen2")
        gf.add_tokenizer(w, vocab, "qwen2")
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    formats = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:  # the head is token_embd itself
            continue
        a = t.detach().float().numpy()
        if a.ndim == 1:
            w.add_tensor(gf.gguf_name(name), a.astype(np.float32))
            continue
        fmt = fmt_of(name, a.shape[1])
        formats[name] = fmt
        with torch.no_grad():
            params[name].copy_(torch.from_numpy(decoded(a, fmt)))
        if name.endswith("q_proj.weight"):
            a = gf.permute(a, heads)
        elif name.endswith("k_proj.weight"):
            a = gf.permute(a, kv)
        w.add_tensor(gf.gguf_name(name), stored(a, fmt), raw_dtype=None if fmt == "f32" else GGML[fmt])
    return gf.finish(w, path), ref.eval(), formats


def plan_step(weights, numerics: str):
    runners = {}

    def step(g, env):
        rows = g.meta["rows"]
        if rows not in runners:
            runners[rows] = NumpyRunner(plan(g, numerics=numerics), weights, exact=True)
        return runners[rows].step(env)

    return step


def _env(g, tokens, pos):
    env = {"token": np.asarray(tokens, np.int32), "pos": np.array([pos], np.int32)}
    for name in g.io.tables:
        env[name] = np.zeros(g.tensors[name].shape, np.float32)
    return env


def check_file(path, ref, formats, what: str):
    """The file loaded: each tensor in its format; the reference interpreter and the fused plan against transformers
    on the decoded weights (f32 numerics); under q8 a prefill chunk of 4 rows run by the plan's exact twins equals the
    interpreter of the q8 step graph — to 1e-6 of the logits' scale, or, where a value within f32 rounding of a
    half rounds to the other word (the twins round each super-block's term to f32 as the kernel does, the
    interpreter sums in f64: one step of one block), no farther than the quantization's own noise — the same next
    token."""
    from lanefuse.engine.front.model import build_step

    cfg, weights = load_model(path)
    for name, fmt in formats.items():
        assert cfg.fmt(name) == fmt, name
    want, want_logits = hf_greedy(ref, PROMPT, N)
    assert len(set(want)) > 3  # a varied run: a wrong weight shows
    for step_fn, how in ((None, "reference"), (fused_step(weights), "fused plan")):
        got = generate(cfg, weights, PROMPT, N, chunk=4, **({"step_fn": step_fn} if step_fn else {}))
        rel = scaled_error(got.logits, want_logits)
        print(f"\n{what} {how}: {rel:.2e}", end="")
        assert got.generated_ids == want and rel < TOL, (how, rel)
    g = build_step(cfg, 4)
    f32 = evaluate(g, weights, _env(g, PROMPT[:4], 0))["logits"]
    iq = evaluate(with_numerics(g, "q8"), weights, _env(g, PROMPT[:4], 0))
    pq = NumpyRunner(plan(g, numerics="q8"), weights, exact=True).step(_env(g, PROMPT[:4], 0))
    noise = float(np.abs(iq["logits"] - f32).max() / np.abs(f32).max())
    err = float(np.abs(pq["logits"] - iq["logits"]).max() / np.abs(iq["logits"]).max())
    print(f"; q8 plan vs q8 interpreter {err:.1e} (q8 vs f32 {noise:.1e})", end="")
    assert noise > 1e-5 and err <= max(1e-6, noise) and np.array_equal(pq["next"], iq["next"])
    return cfg, weights


@pytest.mark.parametrize("fmt", NEW)
def test_a_file_in_each_format_runs_as_transformers_on_its_weights(fmt, tmp_path):
    shape = WIDE if BLOCKS[fmt][0] == 256 else SMALL
    model = gf.tiny_model("llama", **shape)
    path, ref, formats = write(model, tmp_path / f"llama-{fmt}.gguf", lambda n, cols: fmt)
    check_file(path, ref, formats, f"llama {fmt}")


def test_the_q8_step_pairs_each_format_with_llama_cpps_activation_form():
    """Under q8 a product over K-quant or iq4_xs rows reads the q8k form (llama.cpp's q8_K), one over q4_1, q5_0,
    q5_1, iq4_nl rows the q8 form (q8_0's words and f16 scale; for q4_1 / q5_1 llama.cpp's q8_1, whose s = d·Σq the
    product sums from the words)."""
    import dataclasses

    from lanefuse.engine.front.model import build_step
    from test_quant import q8_model

    cfg, _ = q8_model("q8_0")
    for fmt in NEW:
        c = dataclasses.replace(cfg, formats=tuple((n, fmt) for n, _ in cfg.formats))
        g = with_numerics(build_step(c, 1), "q8")
        forms = {g.dtype(op.ins[0]) for op in g.ops if op.kind == "matmul" and g.constants.get(op.ins[1]) is not None
                 and g.constants[op.ins[1]].format == fmt}
        assert forms == ({"q8k"} if fmt in K_FORMATS else {"q8"}), (fmt, forms)


MIXED = {  # (a Q4_K_M / Q3_K_M-like mix: every new format and the old ones, one product each)
    "self_attn.q_proj.weight": "q5_0", "self_attn.k_proj.weight": "q4_1", "self_attn.v_proj.weight": "q5_1",
    "self_attn.o_proj.weight": "iq4_nl", "mlp.gate_proj.weight": "q5_k", "mlp.up_proj.weight": "q3_k",
    "mlp.down_proj.weight": "q2_k",
}
MIXED_1 = {"self_attn.q_proj.weight": "iq4_xs", "self_attn.k_proj.weight": "q4_k", "self_attn.v_proj.weight": "q6_k",
           "self_attn.o_proj.weight": "q8_0", "mlp.gate_proj.weight": "q4_0", "mlp.up_proj.weight": "q5_k",
           "mlp.down_proj.weight": "q5_0"}


def test_a_file_mixing_formats_plans_each_product_in_its_own(tmp_path):
    model = gf.tiny_model("llama", **WIDE)

    def fmt_of(name: str, cols: int) -> str:
        if name == "model.embed_tokens.weight":
            return "q4_0"
        if name == "lm_head.weight":
            return "q6_k"
        i, rest = name.split(".", 3)[2:]
        return (MIXED if i == "0" else MIXED_1)[rest]

    path, ref, formats = write(model, tmp_path / "llama-mixed.gguf", fmt_of)
    cfg, weights = check_file(path, ref, formats, "llama mixed")
    assert set(NEW) <= set(formats.values())
    from lanefuse.engine.front.model import build_step

    read = {}
    for numerics in ("f32", "q8"):
        for x in plan(build_step(cfg, 1), numerics=numerics).launches:
            for w, f in x.launch.weights().items():
                if f is not None and w in formats:
                    assert read.setdefault(w, f) == f, (w, f)
    for name, fmt in formats.items():
        assert read.get(name) == fmt, (name, read.get(name), fmt)


def llama_cpp_apart(path, prompt, n):
    """gf.llama_cpp_greedy in a child process (llama.cpp crashing takes only the child): its tokens and logits, or
    None where it died of a signal."""
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    out = Path(path).with_suffix(".llama.pkl")
    code = ("import pickle, sys; sys.path.insert(0, %r); import gguf_files as gf; "
            "pickle.dump(gf.llama_cpp_greedy(%r, %r, %d), open(%r, 'wb'))"
            % (str(Path(__file__).parent), str(path), list(prompt), n, str(out)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if p.returncode < 0:
        return None
    assert p.returncode == 0, p.stderr[-2000:]
    return pickle.loads(out.read_bytes())


# llama-cpp-python 0.3.36 as installed here (ggml 0.25.3, x86 AVX2/AVX-512 build, extra buffers off; one process a
# file, the files below, 5 steps). lanefuse's q8 numerics — the reference interpreter of the q8 step graph — sum, norm
# and SiLU as llama.cpp's CPU build does (engine/formats/ggml.py: vec_dot's and sgemm's orders, ggml_v_silu, its RMS
# norm), and quantize activations as its x86 SIMD code does (halves to even, id = 127/amax): its logits equal
# llama.cpp's to the bit in every format (iq4_nl was 2.0e-3 apart at step 4 by one flip while the SiLU and the
# products' sums were lanefuse's own; iq4_xs 1.5e-2 by one in the attention while its rope and attention were). The
# fused plan (exact numpy twins of the CUDA launches) computes as the reference does: its tokens are compared, its
# logits loosely (the q8 noise, tests/test_q8_real_width.py's note, wherever a twin rounds otherwise).
LL_STEPS = 5
LL_TOL = 1e-5  # of the logits' scale, the reference interpreter of the q8 graph against llama.cpp (measured <= 1.6e-7)


@pytest.mark.llamacpp
@pytest.mark.parametrize("fmt", NEW)
def test_q8_equals_llama_cpp(fmt, tmp_path):
    """--numerics q8 against llama.cpp (F32 KV cache) on a file whose layers are in each format (embeddings and head
    q8_0), LL_STEPS greedy steps after a 6-token prompt: lanefuse's q8 numerics (the reference interpreter of the q8
    step graph, each product reading the activation form llama.cpp pairs with its rows: q8_0's for q5_0 / iq4_nl, q8_K
    for the K-quants and iq4_xs) give llama.cpp's tokens and its logits within LL_TOL of their scale at every step;
    the fused plan (exact twins) gives its tokens, its logits within the q8 noise (2e-2 of their scale: a flip, the
    note above)."""
    pytest.importorskip("llama_cpp")
    from lanefuse.engine.formats.quantize import with_numerics as numerics

    shape = WIDE if BLOCKS[fmt][0] == 256 else SMALL
    model = gf.tiny_model("llama", **shape)
    edge = ("model.embed_tokens.weight", "lm_head.weight")
    path, _, _ = write(model, tmp_path / f"llama-{fmt}.gguf", lambda n, cols: "q8_0" if n in edge else fmt,
                       tokenizer=True)
    ll = llama_cpp_apart(path, PROMPT, LL_STEPS)
    if ll is None:
        pytest.skip(f"llama.cpp (llama-cpp-python) crashed decoding the {fmt} file (a signal): nothing to compare")
    want, want_logits = ll
    cfg, weights = load_model(path)
    ref = generate(cfg, weights, PROMPT, LL_STEPS, chunk=4,
                   step_fn=lambda g, env: evaluate(numerics(g, "q8"), weights, env))
    fused = generate(cfg, weights, PROMPT, LL_STEPS, chunk=4, step_fn=plan_step(weights, "q8"))
    rel, rel_plan = scaled_error(ref.logits, want_logits), scaled_error(fused.logits, want_logits)
    print(f"\nq8 llama {fmt} vs llama.cpp: reference {rel:.1e}, fused plan {rel_plan:.1e}")
    assert fused.generated_ids == want and rel_plan < 2e-2
    assert ref.generated_ids == want and rel < LL_TOL
