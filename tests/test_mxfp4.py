"""MXFP4 (issue 19): gpt-oss's experts as transformers' checkpoints hold them (`*_blocks` (E, rows, G, 16) fp4 e2m1
pairs, `*_scales` (E, rows, G) e8m0), read as the `mxfp4` block format (formats/blocks.py: a block's scale byte then
its 16 bytes). Its numpy decoding equals transformers' own dequantization (integrations/mxfp4.py) to the bit, the
CUDA decoding (prelude.cu, built for the host) equals the numpy one, and a tiny MXFP4 gpt-oss checkpoint written here
decodes the same greedy tokens as transformers on it (which, on a CPU without triton kernels, dequantizes the experts
at load: the parity is with the model it runs), by the reference interpreter and the fused plan."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lanefuse.engine.formats import blocks
from lanefuse.kernels.common import FORMAT_CODE

from test_blocks import host_qget, same_bits  # noqa: F401  (host_qget: a fixture)


def _random_mxfp4(g, rows: int, groups: int, lo: int = 0, hi: int = 255):
    """Random checkpoint blocks (rows, G, 16) and scales (rows, G) in [lo, hi)."""
    return (g.integers(0, 256, size=(rows, groups, 16), dtype=np.uint8),
            g.integers(lo, hi, size=(rows, groups), dtype=np.uint8))


def test_the_format_table():
    assert blocks.BLOCKS["mxfp4"] == (32, 17) and FORMAT_CODE["mxfp4"] == 7  # prelude.cu's qget
    assert blocks.bytes_per_value("mxfp4") == 17 / 32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoding_equals_transformers_dequantization(dtype):
    """Every fp4 code under every finite e8m0 scale (f32; bf16 where its 8-bit mantissa holds the values exactly:
    always) decodes as transformers' convert_moe_packed_tensors does, to the bit."""
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    g = np.random.default_rng(7)
    E, rows, G = 3, 85, 4  # 255 rows: each scale 0..254 once per group column
    b, s = _random_mxfp4(g, E * rows, G)
    s[:, 0] = np.arange(E * rows) % 255
    want = mx.convert_moe_packed_tensors(torch.from_numpy(b.reshape(E, rows, G, 16)),
                                         torch.from_numpy(s.reshape(E, rows, G)), dtype=getattr(torch, dtype))
    want = want.float().numpy().transpose(0, 2, 1).reshape(E * rows, G * 32)  # back to rows (out, in)
    got = blocks.decode_rows(blocks.pack_mxfp4(b, s), "mxfp4", G * 32)
    assert same_bits(got, want)


def test_the_cuda_decoding_equals_the_numpy_twin(host_qget):  # noqa: F811
    """prelude.cu's mxfp4_get (one value) and qget4's four, built for the host, against formats/blocks.py on every
    code and scale."""
    g = np.random.default_rng(8)
    b, s = _random_mxfp4(g, 255, 3)
    s[:, 0] = np.arange(255)
    raw = blocks.pack_mxfp4(b, s)
    want = blocks.decode_rows(raw, "mxfp4", 96).reshape(-1)
    both = host_qget(raw, "mxfp4", want.size)
    for got in (both[: want.size], both[want.size:]):
        assert same_bits(got, want)


def test_encoder_round_trip_and_packing():
    g = np.random.default_rng(9)
    x = (g.standard_normal((6, 128)) * np.exp(g.uniform(-6, 3, (6, 1)))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    raw = blocks.encode(x, "mxfp4")
    assert raw.shape == (6, 4 * 17)
    y = blocks.decode_rows(raw, "mxfp4", 128)
    amax = np.abs(x).reshape(6, 4, 32).max(axis=2)
    err = np.abs(y - x).reshape(6, 4, 32).max(axis=2)
    assert (err <= amax / 3 + 1e-30).all()  # half fp4's widest step (4 to 6) at a scale below amax / 3
    assert (y[0, :32] == 0).all()
    b, s = blocks.unpack_mxfp4(raw, (6,))
    assert b.shape == (6, 4, 16) and s.shape == (6, 4)
    assert np.array_equal(blocks.pack_mxfp4(b, s), raw)
    assert blocks.encode(np.array([[0.5, -6.0, 3.0, 0.25] * 8], np.float32), "mxfp4")[0, 0] == 127  # 6 = fp4's max


# -- a tiny MXFP4 gpt-oss checkpoint -----------------------------------------------------------------------------

def write_mxfp4(folder) -> None:
    """Folder's gpt-oss checkpoint with its experts re-stored as transformers stores MXFP4 (`_blocks`, `_scales`,
    the rows (out, in) of the products, quantization_config mxfp4)."""
    from safetensors.numpy import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, n_in, n_out = v.shape  # stored (E, in, out)
            rows = np.swapaxes(v.astype(np.float32), 1, 2).reshape(E * n_out, n_in)
            out[k + "_blocks"], out[k + "_scales"] = blocks.unpack_mxfp4(blocks.encode(rows, "mxfp4"), (E, n_out))
        else:
            out[k] = v
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((folder / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(c))


MX = dict(hidden_size=64, intermediate_size=96, head_dim=16)  # rows of whole 32-value blocks


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' MXFP4 loading needs it
    from hf_ref import hf_greedy
    from test_gptoss import N_TOKENS, PROMPT, build

    folder = tmp_path_factory.mktemp("mxfp4") / "gptoss"
    build("float32", folder, **MX)
    write_mxfp4(folder)
    ref = transformers.GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                         experts_implementation="eager").eval()
    want, logits = hf_greedy(ref, PROMPT, N_TOKENS)
    return folder, ref, want, logits


@pytest.mark.hf
def test_the_store_serves_mxfp4_rows_equal_to_transformers_experts(mxfp4_model):
    from lanefuse.engine.front.load import load_model
    from lanefuse.kernels.common import decode

    folder, ref, _, _ = mxfp4_model
    cfg, weights = load_model(folder)
    n = "model.layers.1.mlp.experts."
    assert cfg.fmt(n + "gate_up_proj.rows") == "mxfp4" and cfg.fmt(n + "down_proj.rows") == "mxfp4"
    E, d, f = cfg.moe.experts, cfg.hidden, cfg.inter
    ex = ref.model.layers[1].mlp.experts
    gu = ex.gate_up_proj.detach().float().numpy()  # (E, d, 2f) interleaved
    raw, fmt = weights.store.raw(n + "gate_up_proj.rows")
    rows = decode(raw, fmt).reshape(E, 2 * f, d)
    assert same_bits(rows[:, :f], np.swapaxes(gu[:, :, 0::2], 1, 2)) and \
        same_bits(rows[:, f:], np.swapaxes(gu[:, :, 1::2], 1, 2))
    raw, fmt = weights.store.raw(n + "down_proj.rows")
    assert same_bits(decode(raw, fmt).reshape(E, d, f), np.swapaxes(ex.down_proj.detach().float().numpy(), 1, 2))


@pytest.mark.hf
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("chunk", [1, 8])
def test_mxfp4_gptoss_parity_with_transformers(mxfp4_model, chunk, fused):
    """The reference interpreter and the fused plan (the Moe launch decoding mxfp4 in its twins) against
    transformers on the same checkpoint: the same greedy tokens, logits within 1e-4 of their scale."""
    from hf_ref import margins_ok
    from test_gptoss import N_TOKENS, PROMPT, TOL

    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.generate import generate

    folder, _, want, want_logits = mxfp4_model
    assert len(set(want)) > 3 and margins_ok(want_logits)
    cfg, weights = load_model(folder)
    kw = {}
    if fused:
        pytest.importorskip("egglog")
        from lanefuse.lane.lower.plan import plan
        from lanefuse.lane.run.numpy_runner import NumpyRunner

        runners = {}

        def step(g, env):
            if g.meta["rows"] not in runners:
                p = plan(g)
                assert any(x.launch.census == "moe" and x.launch.format == "mxfp4" for x in p.launches)
                runners[g.meta["rows"]] = NumpyRunner(p, weights)
            return runners[g.meta["rows"]].step(env)

        kw["step_fn"] = step
    got = generate(cfg, weights, PROMPT, N_TOKENS, chunk=chunk, **kw)
    rel = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, want_logits))
    print(f"\nMXFP4 gpt-oss chunk {chunk} {'fused' if fused else 'reference'}: {rel:.2e}")
    assert got.generated_ids == want and rel < TOL


def test_a_broken_mxfp4_checkpoint_is_one_line(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file, save_file

    from lanefuse.engine.errors import UserError
    from lanefuse.engine.front.load import load_model
    from test_gptoss import build

    folder = tmp_path / "g"
    build("float32", folder, **MX)
    write_mxfp4(folder)
    sd = load_file(str(folder / "model.safetensors"))
    bad = dict(sd)
    bad["model.layers.0.mlp.experts.down_proj_scales"] = sd["model.layers.0.mlp.experts.down_proj_scales"].copy()
    bad["model.layers.0.mlp.experts.down_proj_scales"][0, 0, 0] = 255
    save_file(bad, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg, weights = load_model(folder)
    with pytest.raises(UserError, match="down_proj_scales` holds 1 mxfp4 block.*NaN"):
        weights.store.raw("model.layers.0.mlp.experts.down_proj.rows")
    bad = dict(sd)
    del bad["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(bad, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="no tensor `model.layers.0.mlp.experts.down_proj_scales`"):
        load_model(folder)
