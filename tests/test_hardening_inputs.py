"""Bad checkpoint inputs, table-driven: a broken config.json (sizes, numbers, types), a broken safetensors file (spans,
truncation, dtypes, non-finite weights), a broken shard index (paths outside the folder, non-UTF-8), an empty prompt.
Each is a folder written into tmp_path and run through the command; each must end in exit 2 and one line on stderr
naming the file and the key or tensor, never an internal error or a traceback, and never a silent run."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from lanefuse.engine.front.demo import random_arrays
from lanefuse.engine.errors import UserError
from lanefuse.engine.front.hfconfig import config_from_hf
from lanefuse.engine.front.weights import f32_to_bf16

HF = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 50, "rms_norm_eps": 1e-5,
      "max_position_embeddings": 64, "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu"}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


# -- writing checkpoints, by hand where the header is to be broken --------------------------------------------------

def _arrays(config=HF) -> dict[str, np.ndarray]:
    return random_arrays(config_from_hf(config), seed=1)


def _st_bytes(arrays: dict[str, np.ndarray], fmt: str = "F32", edit=None) -> bytes:
    """A safetensors file's bytes (F32, F16 or BF16), its header passed through `edit(header)` first."""
    header, blobs, off = {}, [], 0
    for name, a in arrays.items():
        b = (f32_to_bf16(a) if fmt == "BF16" else a.astype(np.float16 if fmt == "F16" else np.float32)).tobytes()
        header[name] = {"dtype": fmt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if edit:
        edit(header)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def _folder(d: Path, config=HF, arrays=None, fmt="F32", edit=None, raw: bytes | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config) if isinstance(config, dict) else config)
    data = raw if raw is not None else _st_bytes(arrays if arrays is not None else _arrays(), fmt, edit)
    (d / "model.safetensors").write_bytes(data)
    return d


def _last_tensor(arrays) -> str:
    return list(arrays)[-1]


def _sharded(d: Path, weight_map_of=None, index_bytes: bytes | None = None) -> Path:
    """Two shards and an index; `weight_map_of(names_of_shard)` rewrites the index's map."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(HF))
    arrays = _arrays()
    names = list(arrays)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    wmap = {}
    for f, part in parts.items():
        (d / f).write_bytes(_st_bytes({n: arrays[n] for n in part}))
        wmap.update({n: f for n in part})
    if weight_map_of:
        wmap = weight_map_of(wmap)
    (d / "model.safetensors.index.json").write_bytes(
        index_bytes if index_bytes is not None else json.dumps({"weight_map": wmap}).encode())
    return d


def _with(**change):
    return {**HF, **change}


def _set(name, key, value):
    def edit(h):
        h[name][key] = value
    return edit


def _poison(name, value, fmt="F32"):
    def make(d):
        arrays = _arrays()
        arrays[name] = arrays[name].copy()
        arrays[name].reshape(-1)[3] = value
        return _folder(d, arrays=arrays, fmt=fmt)
    return make


def _bf16_nan(d):
    """A bf16 file whose embedding holds one NaN (bits 0x7FC0), written past f32_to_bf16."""
    arrays = _arrays()
    data = bytearray(_st_bytes(arrays, "BF16"))
    n = struct.unpack("<Q", data[:8])[0]
    off = 8 + n + json.loads(data[8:8 + n])[EMBED]["data_offsets"][0]
    data[off + 10:off + 12] = struct.pack("<H", 0x7FC0)
    return _folder(d, raw=bytes(data))


def _truncated(fmt, cut):
    def make(d):
        data = _st_bytes(_arrays(), fmt)
        return _folder(d, raw=data[:-cut] if cut else data[:3])
    return make


def _huge_head(d):
    """Finite weights whose logits overflow: lm_head all 3e38 (f32 holds up to 3.4e38)."""
    arrays = _arrays()
    arrays[HEAD] = np.full_like(arrays[HEAD], 3e38)
    return _folder(d, arrays=arrays)


def _header_bytes(head: bytes):
    return lambda d: _folder(d, raw=struct.pack("<Q", len(head)) + head)


def _config_text(text: bytes):
    def make(d):
        _folder(d)
        (d / "config.json").write_bytes(text)
        return d
    return make


def _overlap(d):
    """lm_head pointed at the embedding's bytes (both (vocab, hidden))."""
    return _folder(d, edit=lambda h: h[HEAD].__setitem__("data_offsets", list(h[EMBED]["data_offsets"])), fmt="BF16")


def _dup_shards(d):
    _sharded(d)
    arrays = _arrays()
    f2 = d / "model-00002-of-00002.safetensors"
    names = list(arrays)
    f2.write_bytes(_st_bytes({n: arrays[n] for n in names[1::2] + [names[0]]}))
    return d


RUN = ("run", "{d}", "--tokens", "2", "--reference", "--prompt-ids", "1")
PLAN = ("plan", "{d}")

# (case id, how the folder is made, the command, what stderr must name)
CASES = [
    # config.json: sizes (item 8)
    ("heads_zero", lambda d: _folder(d, _with(num_attention_heads=0)), RUN, ["config.json", "`num_attention_heads`"]),
    ("heads_zero_plan", lambda d: _folder(d, _with(num_attention_heads=0)), PLAN, ["config.json", "`num_attention_heads`"]),
    ("hidden_text", lambda d: _folder(d, _with(hidden_size="abc")), RUN, ["config.json", "`hidden_size`"]),
    ("hidden_fraction", lambda d: _folder(d, _with(hidden_size=64.7)), PLAN, ["config.json", "`hidden_size`"]),
    ("hidden_bool", lambda d: _folder(d, _with(hidden_size=True)), PLAN, ["config.json", "`hidden_size`"]),
    ("hidden_missing", lambda d: _folder(d, {k: v for k, v in HF.items() if k != "hidden_size"}), PLAN,
     ["config.json", "`hidden_size`"]),
    ("layers_1e8", lambda d: _folder(d, _with(num_hidden_layers=10 ** 8)), RUN, ["config.json", "`num_hidden_layers`"]),
    ("layers_1e8_plan", lambda d: _folder(d, _with(num_hidden_layers=10 ** 8)), PLAN,
     ["config.json", "`num_hidden_layers`"]),
    ("layers_huge", lambda d: _folder(d, _with(num_hidden_layers=10 ** 30)), PLAN, ["config.json", "`num_hidden_layers`"]),
    ("layers_zero", lambda d: _folder(d, _with(num_hidden_layers=0)), RUN, ["config.json", "`num_hidden_layers`"]),
    ("layers_more_than_held", lambda d: _folder(d, _with(num_hidden_layers=3)), PLAN,
     ["config.json", "`num_hidden_layers`", "holds 2"]),
    ("layers_fewer_than_held", lambda d: _folder(d, _with(num_hidden_layers=1)), RUN,
     ["config.json", "`num_hidden_layers`", "holds 2"]),
    ("vocab_negative", lambda d: _folder(d, _with(vocab_size=-5)), PLAN, ["config.json", "`vocab_size`"]),
    ("inter_list", lambda d: _folder(d, _with(intermediate_size=[48])), PLAN, ["config.json", "`intermediate_size`"]),
    ("kv_not_dividing", lambda d: _folder(d, _with(num_key_value_heads=3)), PLAN,
     ["config.json", "`num_key_value_heads`"]),
    ("kv_zero", lambda d: _folder(d, _with(num_key_value_heads=0)), PLAN, ["config.json", "`num_key_value_heads`"]),
    ("heads_not_dividing_hidden", lambda d: _folder(d, _with(num_attention_heads=5, num_key_value_heads=1)), PLAN,
     ["config.json", "`num_attention_heads`", "`hidden_size`"]),
    ("head_dim_zero", lambda d: _folder(d, _with(head_dim=0)), PLAN, ["config.json", "`head_dim`"]),
    ("max_pos_zero", lambda d: _folder(d, _with(max_position_embeddings=0)), PLAN,
     ["config.json", "`max_position_embeddings`"]),
    ("architectures_string", lambda d: _folder(d, _with(architectures="LlamaForCausalLM")), RUN,
     ["config.json", "`architectures`"]),
    ("architectures_numbers", lambda d: _folder(d, _with(architectures=[1])), PLAN, ["config.json", "`architectures`"]),
    ("tie_string", lambda d: _folder(d, _with(tie_word_embeddings="false")), PLAN,
     ["config.json", "`tie_word_embeddings`"]),
    ("act_number", lambda d: _folder(d, _with(hidden_act=3)), PLAN, ["config.json", "`hidden_act`"]),
    # config.json: numbers (item 2)
    ("eps_text", lambda d: _folder(d, _with(rms_norm_eps="1e-5")), RUN, ["config.json", "`rms_norm_eps`"]),
    ("eps_negative", lambda d: _folder(d, _with(rms_norm_eps=-1e-5)), RUN, ["config.json", "`rms_norm_eps`"]),
    ("eps_nan", lambda d: _folder(d, _with(rms_norm_eps=math.nan)), RUN, ["config.json", "`rms_norm_eps`"]),
    ("theta_zero", lambda d: _folder(d, _with(rope_theta=0)), RUN, ["config.json", "`rope_theta`"]),
    ("theta_negative", lambda d: _folder(d, _with(rope_theta=-1)), RUN, ["config.json", "`rope_theta`"]),
    ("theta_inf", lambda d: _folder(d, _with(rope_theta=math.inf)), RUN, ["config.json", "`rope_theta`"]),
    ("theta_v5_zero", lambda d: _folder(d, _with(rope_parameters={"rope_type": "default", "rope_theta": 0})), RUN,
     ["config.json", "`rope_parameters.rope_theta`"]),
    ("linear_factor_zero", lambda d: _folder(d, _with(rope_scaling={"rope_type": "linear", "factor": 0})), RUN,
     ["config.json", "`rope_scaling.factor`"]),
    ("linear_factor_text", lambda d: _folder(d, _with(rope_scaling={"rope_type": "linear", "factor": "2"})), RUN,
     ["config.json", "`rope_scaling.factor`"]),
    ("llama3_equal_factors", lambda d: _folder(d, _with(rope_scaling={**LLAMA3, "high_freq_factor": 1.0})), RUN,
     ["config.json", "low_freq_factor", "high_freq_factor"]),
    ("llama3_original_zero", lambda d: _folder(d, _with(rope_scaling={**LLAMA3, "original_max_position_embeddings": 0})),
     RUN, ["config.json", "`rope_scaling.original_max_position_embeddings`"]),
    ("partial_two", lambda d: _folder(d, _with(partial_rotary_factor=2)), RUN, ["config.json", "`partial_rotary_factor`"]),
    ("rope_scaling_list", lambda d: _folder(d, _with(rope_scaling=[1])), PLAN, ["config.json", "`rope_scaling`"]),
    # config.json: the file itself (item 10)
    ("config_not_utf8", _config_text(b'{"architectures": ["\xff\xfe"]}'), RUN, ["config.json", "UTF-8"]),
    ("config_latin1", _config_text('{"hidden_act": "sil\u00fc"}'.encode("latin-1")), PLAN, ["config.json", "UTF-8"]),
    # safetensors spans (item 3)
    ("f32_truncated", _truncated("F32", 4), RUN, ["model.safetensors", f"`{_last_tensor(_arrays())}`", "truncated"]),
    ("bf16_truncated", _truncated("BF16", 4), RUN, ["model.safetensors", f"`{_last_tensor(_arrays())}`",
                                                   "truncated"]),
    ("bf16_truncated_plan", _truncated("BF16", 4), PLAN, ["model.safetensors", f"`{_last_tensor(_arrays())}`"]),
    ("file_of_three_bytes", _truncated("F32", 0), PLAN, ["model.safetensors", "8-byte"]),
    ("header_past_end", lambda d: _folder(d, raw=struct.pack("<Q", 10 ** 6) + b"{}"), PLAN,
     ["model.safetensors", "header claims"]),
    ("header_not_json", _header_bytes(b"{not json}      "), PLAN, ["model.safetensors", "not JSON"]),
    ("header_not_utf8", _header_bytes(b'{"\xff": 1}     '), PLAN, ["model.safetensors", "UTF-8"]),
    ("header_a_list", _header_bytes(b"[1, 2]  "), PLAN, ["model.safetensors", "not a JSON object"]),
    ("bf16_two_bytes_long", lambda d: _folder(d, fmt="BF16", edit=_set(EMBED, "data_offsets", [0, 2])), RUN,
     ["model.safetensors", f"`{EMBED}`", "needs"]),
    ("f32_short_span", lambda d: _folder(d, edit=_set(HEAD, "data_offsets", [0, 4])), RUN,
     ["model.safetensors", f"`{HEAD}`", "needs"]),
    ("bf16_head_on_embedding", _overlap, RUN, ["model.safetensors", f"`{EMBED}`", f"`{HEAD}`", "overlap"]),
    ("bf16_past_the_end", lambda d: _folder(d, fmt="BF16", edit=_set(HEAD, "data_offsets", [10 ** 9, 10 ** 9 + 3200])),
     RUN, ["model.safetensors", f"`{HEAD}`", "past the end"]),
    ("unknown_dtype", lambda d: _folder(d, edit=_set(EMBED, "dtype", "F33")), PLAN,
     ["model.safetensors", f"`{EMBED}`", "unknown dtype"]),
    ("offsets_not_a_pair", lambda d: _folder(d, edit=_set(EMBED, "data_offsets", ["a"])), PLAN,
     ["model.safetensors", f"`{EMBED}`", "data_offsets"]),
    ("offsets_negative", lambda d: _folder(d, edit=_set(EMBED, "data_offsets", [-8, 3192])), PLAN,
     ["model.safetensors", f"`{EMBED}`", "data_offsets"]),
    ("shape_negative", lambda d: _folder(d, edit=_set(EMBED, "shape", [-50, -32])), PLAN,
     ["model.safetensors", f"`{EMBED}`", "shape"]),
    ("entry_not_mapping", lambda d: _folder(d, edit=lambda h: h.__setitem__(EMBED, 3)), PLAN,
     ["model.safetensors", f"`{EMBED}`"]),
    # non-finite weights (item 2)
    ("f32_one_nan", _poison(EMBED, np.nan), RUN, ["model.safetensors", f"`{EMBED}`", "NaN or inf"]),
    ("f32_inf", _poison("model.layers.1.mlp.down_proj.weight", np.inf), RUN,
     ["model.safetensors", "`model.layers.1.mlp.down_proj.weight`", "NaN or inf"]),
    ("f16_minus_inf", _poison("model.norm.weight", -np.inf, fmt="F16"), RUN,
     ["model.safetensors", "`model.norm.weight`", "NaN or inf"]),
    ("bf16_nan", _bf16_nan, RUN, ["model.safetensors", f"`{EMBED}`", "NaN or inf"]),
    ("nan_fused_plan", _poison(HEAD, np.nan), ("run", "{d}", "--tokens", "2", "--prompt-ids", "1"),
     ["model.safetensors", f"`{HEAD}`", "NaN or inf"]),
    ("logits_overflow", _huge_head, RUN[:-1] + ("1,2,3",), ["prefill chunk of prompt rows 0..2", "non-finite"]),
    ("logits_overflow_fused", _huge_head, ("run", "{d}", "--tokens", "2", "--prompt-ids", "4"),
     ["prefill chunk of prompt rows 0..0", "non-finite"]),
    # shard indexes (items 10, 11)
    ("index_etc_passwd", lambda d: _sharded(d, lambda m: {**m, EMBED: "/etc/passwd"}), PLAN,
     ["model.safetensors.index.json", "/etc/passwd", "outside the checkpoint folder"]),
    ("index_dotdot", lambda d: _sharded(d, lambda m: {**m, EMBED: "../model-00001-of-00002.safetensors"}), PLAN,
     ["model.safetensors.index.json", "outside the checkpoint folder"]),
    ("index_not_utf8", lambda d: _sharded(d, index_bytes=b'{"weight_map": {"\xff": "a"}}'), PLAN,
     ["model.safetensors.index.json", "UTF-8"]),
    ("index_map_a_list", lambda d: _sharded(d, index_bytes=b'{"weight_map": ["a"]}'), PLAN,
     ["model.safetensors.index.json", "weight_map"]),
    ("index_missing_shard", lambda d: _sharded(d, lambda m: {**m, EMBED: "model-00003-of-00002.safetensors"}), PLAN,
     ["model-00003-of-00002.safetensors", "model.safetensors.index.json"]),
    ("tensor_in_two_shards", _dup_shards, PLAN, [f"`{list(_arrays())[0]}`", "in both"]),
    # the prompt (item 4)
    ("prompt_ids_empty", lambda d: _folder(d), ("run", "{d}", "--tokens", "2", "--reference", "--prompt-ids", ""),
     ["--prompt-ids", "no token ids"]),
    ("prompt_ids_commas", lambda d: _folder(d), ("run", "{d}", "--tokens", "2", "--reference", "--prompt-ids", ",,"),
     ["--prompt-ids", "no token ids"]),
]


def _cli(args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's folder written, and every command run, a few at once (each is a fresh process)."""
    base = tmp_path_factory.mktemp("bad")
    jobs = {}
    for name, make, cmd, _ in CASES:
        d = make(base / name)
        jobs[name] = [a.format(d=d) for a in cmd]
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip(jobs, pool.map(_cli, jobs.values())))
    return done


def test_the_table_is_big_and_names_unique():
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names)) and len(names) >= 60


@pytest.mark.parametrize("name,expect", [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clean_line(results, name, expect):
    r = results[name]
    err = r.stderr
    assert r.returncode == 2, f"rc {r.returncode}\n{err}\n{r.stdout[-500:]}"
    assert "internal error" not in err and "Traceback" not in err and "Warning" not in err, err
    lines = err.splitlines()
    # one error line, the last; any line before it is one of lanefuse's own notes (the KV cache rows it chose)
    assert lines and lines[-1].startswith("lanefuse: error: ") and all(l.startswith("lanefuse: ") for l in lines), err
    assert sum(l.startswith("lanefuse: error: ") for l in lines) == 1, err
    for word in expect:
        assert word.lower() in lines[-1].lower(), f"{word!r} not in {lines[-1]!r}"
    assert len(lines[-1]) < 600, err


# -- good inputs near the edges still load ---------------------------------------------------------------------------

@pytest.mark.parametrize("change", [
    {"hidden_size": 32.0},  # an integral float
    {"num_key_value_heads": None, "head_dim": None, "rope_scaling": None, "rope_parameters": None},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    {"rope_scaling": LLAMA3},
    {"partial_rotary_factor": 0.5},
    {"tie_word_embeddings": None, "mlp_bias": False, "attention_bias": False, "use_sliding_window": False},
])
def test_good_configs_still_read(change):
    cfg = config_from_hf({**HF, **change})
    assert cfg.hidden == 32 and cfg.heads == 4


def test_symlinked_shards_inside_the_folder_load(tmp_path):
    """A hub snapshot keeps its shards as symlinks into a blob store outside the folder: still fine."""
    from lanefuse.engine.front.load import load_model

    d = _sharded(tmp_path / "m")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for f in d.glob("*.safetensors"):
        (blobs / f.name).write_bytes(f.read_bytes())
        f.unlink()
        f.symlink_to(blobs / f.name)
    cfg, w = load_model(d)
    assert w.get(EMBED).shape == (50, 32)


def test_the_decode_step_is_named_when_its_logits_are_not_finite():
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.lane.run.generate import generate

    cfg, w = demo_model(64)
    calls = []

    def step(g, env):
        calls.append(len(env["token"]))
        logits = np.zeros((1, cfg.vocab), np.float32)
        if len(calls) == 3:
            logits[0, 7] = np.nan
        return {"logits": logits, "next": np.asarray([1], np.int32)}

    with pytest.raises(UserError, match=r"the decode step of generated token 3 \(position 4\) gave 1 non-finite "
                                        r"logit\(s\) of 512"):
        generate(cfg, w, [1, 2, 3], 5, step_fn=step, chunk=8)


def test_json_output_refuses_nan_in_words():
    from lanefuse.lane.lower.files import json_text

    assert json_text({"a": [1.5]}, "x") == '{"a": [1.5]}\n'
    with pytest.raises(UserError, match=r"--json out.json: not written: .*non-finite number \(NaN or inf\)"):
        json_text({"logits": [[0.0, float("nan")]]}, "--json out.json")


@pytest.mark.parametrize("seed", [-1, 1.5, True, "3"])
def test_a_step_yamls_random_seed_must_be_a_non_negative_integer(seed):
    from lanefuse.engine.front.demo import demo_config
    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.front.stepweights import step_weights

    g = build_step(demo_config(16), 1)
    g.meta["weights"] = {"random": seed}
    with pytest.raises(UserError, match="needs a non-negative integer seed"):
        step_weights(g)
