"""GGUF test files made here: tiny transformers models (random seeded weights of a scale that keeps greedy tokens
apart), written with the gguf package's writer as llama.cpp's convert_hf_to_gguf.py writes them (its tensor names and
metadata keys, llama's q/k rows permuted for the adjacent-pair rotation, 1-D tensors in f32), with a BPE tokenizer
trained on a few sentences stored in the metadata as the converter stores one; and the transformers reference on the
same weights decoded by gguf.quants.dequantize."""

from __future__ import annotations

import copy
import zlib
from pathlib import Path

import numpy as np

from lanefuse.engine.front.gguf_vocab import PRES  # llama.cpp's pre-tokenizers (src/llama-vocab.cpp)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A GGUF file holds a model's tensors and its tokenizer; llama.cpp reads it in place.",
    "Numbers like 3, 33, 333 and 3.14159 split into digits, and don't they?",
    "Ünïcödé, emojis 🦙🚀 and 中文 text are bytes to a byte-level BPE.",
    "  leading spaces,\ttabs\nand new lines\n\nmatter to the pre-tokenizer's regex.",
    "I'll say it's done: we've tested 'RE, 'Ve and 'd contractions.",
]

HF_ARCH = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3moe": "Qwen3Moe", "qwen2moe": "Qwen2Moe",
           "phi3": "Phi3", "mixtral": "Mixtral"}
GGUF_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K",
              "q6_k": "Q6_K", "mxfp4": "MXFP4"}
# general.file_type as llama.cpp's converter writes it (its LlamaFileType)
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32, "q4_k": 15, "q6_k": 18, "mxfp4": 38}
NAMES_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
NAMES_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
               "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.bias": "attn_q.bias",
               "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
               "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
               "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
               "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
               "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
               "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
               "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
               "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
F32_KEPT = ("mlp.gate.weight", "mlp.shared_expert_gate.weight", "conv1d.weight")  # a mixture's router and
# shared-expert gate, a delta net's convolution: f32, as llama.cpp's converter and quantizer keep ffn_gate_inp (and the
# gate score a 1-D tensor) and ssm_conv1d


def kept_f32(hf: str) -> bool:
    return hf.endswith(F32_KEPT)


def gguf_name(hf: str) -> str:
    if hf in NAMES_TOP:
        return NAMES_TOP[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{NAMES_LAYER[rest]}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (PEERS-NOTES.md): each head's rows for adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_model(arch: str, seed: int = 0, **kw):
    """A transformers model of `arch` (llama | qwen2 | qwen3), f32, its weights re-initialised at a live scale."""
    import torch
    import transformers

    cls = HF_ARCH[arch]
    cfg = getattr(transformers, f"{cls}Config")(max_position_embeddings=kw.pop("max_position_embeddings", 128), **kw)
    torch.manual_seed(zlib.crc32(f"{arch}{seed}".encode()))
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p) * (0.1 if cfg.tie_word_embeddings else 1.0))
            elif pname.endswith("mlp.gate.weight"):  # a mixture's router: decisive choices
                p.copy_(3 * torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:  # rows (out, in), or a mixture's experts (E, out, in)
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def encode(values: np.ndarray, fmt: str) -> np.ndarray:
    """f32 (rows, cols) -> the bytes GGUF holds in `fmt` (f32/f16 as themselves; the block and bf16 formats uint8)."""
    import gguf

    values = np.ascontiguousarray(values, dtype=np.float32)
    if fmt == "f32":
        return values
    if fmt == "f16":
        return values.astype(np.float16)
    if fmt in ("q4_k", "q6_k"):
        from lanefuse.engine.formats.blocks import encode as block_encode  # the K-quants: the blocks helper's quantizer

        return np.asarray(block_encode(values, fmt), dtype=np.uint8).reshape(values.shape[0], -1)
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[GGUF_TYPES[fmt]])


def decoded(values: np.ndarray, fmt: str) -> np.ndarray:
    """What a `fmt` tensor of `values` holds, decoded by gguf.quants.dequantize (f32)."""
    import gguf

    if fmt == "f32":
        return np.asarray(values, dtype=np.float32)
    if fmt == "f16":
        return np.asarray(values, dtype=np.float16).astype(np.float32)
    return gguf.quants.dequantize(encode(values, fmt), gguf.GGMLQuantizationType[GGUF_TYPES[fmt]]).astype(np.float32)


def ggml_type(fmt: str):
    """The ggml type the writer is told a `fmt` tensor's bytes are (None: f32 and f16, numpy's own dtypes)."""
    import gguf

    return None if fmt in ("f32", "f16") else gguf.GGMLQuantizationType[GGUF_TYPES[fmt]]


def add_rows(w, name: str, a: np.ndarray, fmt: str) -> None:
    """f32 `a` (rows, cols), or a mixture's experts (E, rows, cols), as GGUF tensor `name` in `fmt`, row by row."""
    data = encode(a.reshape(-1, a.shape[-1]), fmt)
    w.add_tensor(name, data.reshape(a.shape[:-1] + (-1,)), raw_dtype=ggml_type(fmt))


def add_shape_keys(w, path: Path, cfg, heads: int, kv: int, key: int, value: int) -> None:
    """The keys every converter writes first from a transformers config `cfg`: the file's name, the context, the
    widths, the block count, the heads (`kv` key/value heads), the rope base, the norms' epsilon, the key and value
    widths."""
    w.add_name(Path(path).stem)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(key)
    w.add_value_length(value)


def add_tokenizer(w, tokenizer, pre: str = "qwen2", eos: int = 0, bos: int | None = None,
                  add_bos: bool | None = None) -> None:
    """A byte-level BPE (bpe_tokenizer's tokens, merges, token types) in the metadata, as the converter stores one."""
    tokens, merges, types = tokenizer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(eos)
    if bos is not None:
        w.add_bos_token_id(bos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)


def finish(w, path: Path) -> Path:
    """Write the file `w` holds (header, metadata, tensors) and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def check_plans(cfg, weights, want: list[int], want_logits, prompt: list[int], n: int, what: str,
                tol: float = 1e-4) -> None:
    """The reference interpreter and the fused plan (chunks of 4, then decode steps) on a file's model (`cfg`,
    `weights`) against transformers' greedy tokens and logits on the file's weights: the same tokens, logits within
    `tol` of their scale (printed, `what` naming the file)."""
    from hf_ref import fused_step, scaled_error

    from lanefuse.lane.run.generate import generate

    for step_fn, how in ((None, "reference"), (fused_step(weights), "fused plan")):
        got = generate(cfg, weights, prompt, n, chunk=4, **({"step_fn": step_fn} if step_fn else {}))
        rel = scaled_error(got.logits, want_logits)
        print(f"\nGGUF {what} {how}: {rel:.2e}")
        assert got.generated_ids == want
        assert rel < tol


def llama_cpp_greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """llama.cpp (llama-cpp-python) decoding GGUF file `path` greedily, step by step as lanefuse decodes, its KV cache
    in f32, its extra weight buffers off (llama_cpp_dump.py: its AMX kernels fault in this sandbox, on q8_0, q4_0,
    K-quant and f16 files): the tokens and each step's logits."""
    from llama_cpp_dump import greedy

    return greedy(path, prompt, n, n_ctx=64)


def check_llama_cpp(path: Path, ref, prompt: list[int], n: int, what: str, tol: float = 1e-4) -> None:
    """llama.cpp decoding file `path`, transformers' `ref` (the model holding the file's weights) and lanefuse's fused
    plan on the file (chunks of 4, then decode steps): the same greedy tokens, llama.cpp's logits within `tol` of
    their scale of both (printed, `what` naming the file)."""
    from hf_ref import fused_step, hf_greedy, scaled_error

    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.generate import generate

    want, want_logits = hf_greedy(ref, prompt, n)
    ll, ll_logits = llama_cpp_greedy(path, prompt, n)
    cfg, weights = load_model(path)
    got = generate(cfg, weights, prompt, n, step_fn=fused_step(weights), chunk=4)
    vs_hf, vs_lane = scaled_error(ll_logits, want_logits), scaled_error(ll_logits, got.logits)
    print(f"\nllama.cpp {what}: vs transformers {vs_hf:.2e}, vs lanefuse {vs_lane:.2e}")
    assert ll == want == got.generated_ids
    assert vs_hf < tol and vs_lane < tol


def bpe_tokenizer(vocab_size: int, pre: str = "qwen2", specials=("<|endoftext|>", "<|im_start|>"),
                  texts: list[str] | None = None):
    """A byte-level BPE trained on `texts` (SENTENCES) with the pre-tokenizer `pre` names, exactly `vocab_size` tokens
    (padded with [PADi] as the converter pads): (tokenizers.Tokenizer, tokens, merges, token types)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lanefuse.engine.front.gguf_vocab import splits

    tok = Tokenizer(models.BPE(ignore_merges=PRES[pre].ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits(PRES[pre]) + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((texts or SENTENCES) * 4, trainer)
    import json

    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert len(vocab) <= vocab_size, (len(vocab), vocab_size)
    rev = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
        else:
            tokens.append(rev[i])
            types.append(3 if rev[i] in specials else 1)  # CONTROL | NORMAL
    return tok, tokens, merges, types


def write_vocab_gguf(path: Path, tokenizer, pre: str, bos: int | None = None, eos: int = 0,
                     add_bos: bool | None = None, chat_template: str | None = None) -> Path:
    """A GGUF file holding a tokenizer (bpe_tokenizer's tokens, merges, types) and a one-layer llama's shape keys, no
    tensors: what llama.cpp's vocab_only load and lanefuse's tokenizer read."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(Path(path).stem)
    for add, v in ((w.add_context_length, 64), (w.add_embedding_length, 64), (w.add_block_count, 1),
                   (w.add_feed_forward_length, 64), (w.add_head_count, 2), (w.add_head_count_kv, 2)):
        add(v)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokenizer[0]))
    add_tokenizer(w, tokenizer, pre, eos, bos, add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    return finish(w, path)


def stored_format(fmt: str, cols: int) -> str:
    """The format a 2-D tensor of `cols`-wide rows is written in: a K-quant falls back to q8_0 for rows that are not a
    whole number of its 256-value blocks, as llama.cpp's quantizer falls back (to a 32-value format) for them."""
    return "q8_0" if fmt in ("q4_k", "q6_k") and cols % 256 else fmt


def write_gguf(model, path: Path, fmt: str = "f32", arch: str | None = None, tokenizer=None, pre: str = "qwen2",
               bos: int | None = None, eos: int = 0, add_bos: bool | None = None, out_fmt: str | None = None,
               rope_freqs: np.ndarray | None = None, chat_template: str | None = None) -> Path:
    """`model` (a transformers model) as a GGUF file of `fmt` 2-D tensors (`out_fmt` for output.weight), with
    `tokenizer` (bpe_tokenizer's tokens, merges, types) and `chat_template` in its metadata where given."""
    import gguf

    cfg = model.config
    arch = arch or {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                    "Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe",
                    "Phi3ForCausalLM": "phi3", "MixtralForCausalLM": "llama"}[type(model).__name__]
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    add_shape_keys(w, path, cfg, heads, kv, head_dim, head_dim)
    w.add_file_type(FILE_TYPES[fmt])
    if arch in ("qwen3moe", "qwen2moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if type(model).__name__ == "MixtralForCausalLM":  # llama with experts, as llama.cpp's converter writes Mixtral
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "phi3":  # as llama.cpp's converter: the rotated width, and the window where the config has one
        rope = getattr(cfg, "rope_parameters", None) or {}
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if cfg.sliding_window is not None:
            w.add_sliding_window(cfg.sliding_window)
    if tokenizer is not None:
        add_tokenizer(w, tokenizer, pre, eos, bos, add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute(a, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute(a, kv)
        f = (out_fmt or fmt) if name == "lm_head.weight" else fmt
        if a.ndim >= 2:
            f = stored_format(f, a.shape[-1])
        if name.endswith("mlp.experts.gate_up_proj"):  # (E, 2f, d): llama.cpp's gate and up experts apart
            half = a.shape[1] // 2
            blk = gguf_name(name.replace("mlp.experts.gate_up_proj", "mlp.gate.weight")).rsplit(".", 2)[0]
            for part, role in ((a[:, :half], "gate"), (a[:, half:], "up")):
                add_rows(w, f"{blk}.ffn_{role}_exps.weight", part, f)
        elif a.ndim == 3:  # a mixture's experts (E, rows, cols): one 3-D tensor
            add_rows(w, gguf_name(name), a, f)
        elif a.ndim == 1 or kept_f32(name):
            w.add_tensor(gguf_name(name), a.astype(np.float32).reshape(-1) if a.shape[0] == 1 else a)
        else:
            add_rows(w, gguf_name(name), a, f)
    return finish(w, path)


def reference(model, fmt: str = "f32", out_fmt: str | None = None):
    """A copy of `model` whose 2-D weights are what a `fmt` GGUF file of it holds, decoded (f32)."""
    import torch

    ref = copy.deepcopy(model)
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim >= 2 and not kept_f32(name):
                f = stored_format((out_fmt or fmt) if name == "lm_head.weight" and not tied else fmt, p.shape[-1])
                rows = p.detach().numpy().reshape(-1, p.shape[-1])
                p.copy_(torch.from_numpy(decoded(rows, f)).reshape(p.shape))
    return ref.eval()


def spm_vocab(extra: int = 120):
    """A SentencePiece-style (`llama`) vocabulary as llama.cpp's converter writes one: <unk>, <s>, </s>, the 256
    byte tokens <0xXX>, then pieces (▁ for a space) learnt by BPE on SENTENCES, scored by their order:
    (tokens, scores, token types)."""
    import json

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=extra, show_progress=False)
    tok.train_from_iterator(SENTENCES * 4, trainer)
    learnt = json.loads(tok.to_str())["model"]["vocab"]
    pieces = [t for t, _ in sorted(learnt.items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)  # UNKNOWN, CONTROL, BYTE, NORMAL
    # llama.cpp merges the highest-scored piece first; longer pieces learnt later score lower, as in real files
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def write_spm(model, path: Path, vocab) -> Path:
    """`model` as an f32 GGUF file holding a SentencePiece (`llama`) tokenizer `vocab` (spm_vocab's)."""
    import gguf

    tokens, scores, types = vocab
    write_gguf(model, path, "f32")
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(path) + ".tmp", r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = f.types[0]
        w.add_array(key, f.contents()) if vt == gguf.GGUFValueType.ARRAY else w.add_key_value(key, f.contents(), vt)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for t in r.tensors:
        raw = None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
        w.add_tensor(t.name, np.array(t.data), raw_dtype=raw)
    finish(w, path)
    Path(str(path) + ".tmp").replace(path)
    return Path(path)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute`: each head's rows of adjacent pairs back to transformers' two halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference_from_file(model, path: Path):
    """A copy of `model` holding the weights GGUF file `path` holds (any mix of formats, e.g. llama.cpp's own
    quantizer's), each decoded by gguf.quants.dequantize, llama's q/k rows put back by `unpermute`."""
    import gguf
    import torch

    cfg = model.config
    llama = type(model).__name__ == "LlamaForCausalLM"
    held = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in gguf.GGUFReader(path).tensors}
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            a = held[gguf_name(name) if not (name == "lm_head.weight" and cfg.tie_word_embeddings)
                     else "token_embd.weight"]
            if llama and name.endswith("q_proj.weight"):
                a = unpermute(a, cfg.num_attention_heads)
            elif llama and name.endswith("k_proj.weight"):
                a = unpermute(a, cfg.num_key_value_heads)
            p.copy_(torch.from_numpy(np.array(a, dtype=np.float32)).reshape(p.shape))
    return ref.eval()


# -- Qwen3-Next (llama.cpp's `qwen3next`) ------------------------------------------------------------------------------

QWEN3NEXT_LAYER = {"input_layernorm.weight": "attn_norm.weight",
                   "post_attention_layernorm.weight": "post_attention_norm.weight",
                   "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
                   "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a",
                   "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight"}


def write_qwen3next(model, path: Path, fmt: str = "f32", legacy: bool = False, tokenizer=None,
                    out_fmt: str | None = None) -> Path:
    """A transformers Qwen3-Next (a mixture in every layer) as llama.cpp's convert_hf_to_gguf.py's Qwen3NextModel
    writes it: its keys (ssm.*, full_attention_interval, the rotary width), A_log as -exp(A_log), dt_bias as
    ssm_dt.bias, the convolution squeezed to (channels, taps) and kept f32, every norm but the delta net's own held as
    1 + w, and in_proj_qkvz as attn_qkv (every key-head group's q rows, then their k, then their v) and attn_gate (z)
    — or, `legacy`, as ssm_in, stored as transformers holds it (older converters)."""
    import gguf

    cfg = model.config
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    w = gguf.GGUFWriter(str(path), "qwen3next")
    add_shape_keys(w, path, cfg, heads, kv, hd, hd)
    w.add_file_type(FILE_TYPES[fmt])
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(dv * hv)
    linear = [t == "linear_attention" for t in cfg.layer_types]
    n = linear.index(False) + 1 if False in linear else len(linear) + 1
    if all(x == bool((i + 1) % n) for i, x in enumerate(linear)):
        w.add_full_attention_interval(n)
    else:  # no one interval: llama.cpp's per-layer flags
        w.add_array("qwen3next.attention.recurrent_layers", linear)
    rope = getattr(cfg, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 0.25))
    w.add_rope_dimension_count(int(hd * partial))
    if tokenizer is not None:
        add_tokenizer(w, tokenizer)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def rows(name: str, a: np.ndarray, f: str) -> None:
        add_rows(w, name, a, stored_format(f, a.shape[-1]))

    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        if name in NAMES_TOP:
            if name == "model.norm.weight":
                w.add_tensor(NAMES_TOP[name], (a + np.float32(1.0)).astype(np.float32))
            else:
                rows(NAMES_TOP[name], a, (out_fmt or fmt) if name == "lm_head.weight" else fmt)
            continue
        _, _, i, rest = name.split(".", 3)
        blk = f"blk.{i}."
        if rest.endswith("in_proj_qkvz.weight"):
            if legacy:
                rows(blk + "ssm_in.weight", a, fmt)
            else:  # the converter's corrected order: every group's q, then k, then v (attn_qkv); z (attn_gate)
                r = hv // hk
                g = a.reshape(hk, 2 * dk + 2 * r * dv, -1)
                q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
                rows(blk + "attn_qkv.weight", np.concatenate([x.reshape(-1, a.shape[-1]) for x in (q, k, v)]), fmt)
                rows(blk + "attn_gate.weight", z.reshape(-1, a.shape[-1]), fmt)
        elif rest in QWEN3NEXT_LAYER:
            gname = blk + QWEN3NEXT_LAYER[rest]
            if rest.endswith("A_log"):
                w.add_tensor(gname, -np.exp(a.astype(np.float32)))
            elif rest.endswith("conv1d.weight"):
                w.add_tensor(gname, np.ascontiguousarray(a.reshape(a.shape[0], -1), dtype=np.float32))
            elif a.ndim == 1:
                w.add_tensor(gname, a if rest.startswith("linear_attn.") else (a + np.float32(1.0)))
            else:
                rows(gname, a, fmt)
        elif rest.endswith(("q_norm.weight", "k_norm.weight")):
            w.add_tensor(gguf_name(name), (a + np.float32(1.0)).astype(np.float32))
        elif rest.endswith("mlp.experts.gate_up_proj"):
            half = a.shape[1] // 2
            for part, role in ((a[:, :half], "gate"), (a[:, half:], "up")):
                rows(f"{blk}ffn_{role}_exps.weight", part, fmt)
        elif a.ndim == 3:
            rows(gguf_name(name), a, fmt)
        elif a.ndim == 1 or kept_f32(name):
            w.add_tensor(gguf_name(name), a.astype(np.float32).reshape(-1) if a.shape[0] == 1 else a)
        else:
            rows(gguf_name(name), a, fmt)
    return finish(w, path)
