"""The front: a checkpoint folder (config.json + safetensors) or a GGUF file (or a folder holding one) read into a
`ModelConfig` and its weight store, every tensor the step reads checked for presence and shape, and each one's stored
format recorded in the config."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from lanefuse.engine.errors import UserError
from lanefuse.engine.jsonfile import read_json
from lanefuse.engine.front.family import of_config
from lanefuse.engine.front.hfconfig import config_from_hf
from lanefuse.engine.front.model import ModelConfig
from lanefuse.engine.front.weights import Weights

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _progress(items, desc: str):
    if not sys.stderr.isatty():
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="tensor", leave=False)


def _check_layers(cfg_path: Path, layers: int, stored: set[str], prefix: str = "model.layers.", extra: int = 0) -> None:
    """`num_hidden_layers` against the layers the checkpoint holds tensors for (model.layers.N.*, or the prefix
    a family's text model lives under); up to `extra` layers after them (next-token-prediction layers the step
    does not read) are let be."""
    pat = _LAYER if prefix == "model.layers." else re.compile(re.escape(prefix) + r"(\d+)\.")
    held = {int(m.group(1)) for m in map(pat.match, stored) if m}
    held -= set(range(layers, layers + extra))
    if not held:
        raise UserError(f"{cfg_path.parent}: the checkpoint has no tensor `{prefix}0.input_layernorm.weight` "
                        f"(no {prefix}* tensors at all; config.json's `num_hidden_layers` is {layers})")
    if len(held) != layers or held != set(range(layers)):  # the length first: never a set of 10^8
        have = f"{prefix}0..{max(held)}" if held == set(range(len(held))) else \
            f"layers {sorted(held)[:8]}"
        raise UserError(f"{cfg_path}: `num_hidden_layers` is {layers}, but the checkpoint holds {len(held)} "
                        f"layer(s) ({have})")


def load_model(path: str | Path, max_len: int = 512) -> tuple[ModelConfig, Weights]:
    """The model in checkpoint folder `path` (or GGUF file, or a folder holding one GGUF file and no config.json): its
    config (KV caches of `max_len` rows, at most the model's max_position_embeddings / context length) and its
    weights."""
    folder = Path(path)
    if not folder.exists():
        raise UserError(f"{folder}: no such file or folder")
    if not folder.is_dir() and folder.name.endswith(".gguf"):  # a FIFO too: refused by name, not waited on
        return _load_gguf(folder, max_len)
    if not folder.is_dir():
        raise UserError(f"{folder}: expected a checkpoint folder (config.json and safetensors files) or a .gguf file")
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        from lanefuse.engine.front.gguf import find_gguf

        one = find_gguf(folder)
        if one is not None:
            return _load_gguf(one, max_len)
        raise UserError(f"{folder}: no config.json in this folder (expected a Hugging Face checkpoint folder or a "
                        f".gguf file)")
    raw_cfg = read_json(cfg_path, "config.json is JSON")
    if not isinstance(raw_cfg, dict):
        raise UserError(f"{cfg_path}: expected a JSON object")
    cfg = config_from_hf(raw_cfg, str(cfg_path), max_len=max_len, name=folder.resolve().name)
    store = Weights.from_folder(folder)  # the headers read (each checked, nothing sized by the config allocated)
    stored = set(store.names())
    relayout = getattr(cfg, "with_layout", None)  # a family whose checkpoints name the text model two ways
    if relayout is not None:
        cfg = relayout(stored)
    _check_layers(cfg_path, cfg.layers, stored, getattr(cfg, "layer_prefix", "model.layers."),
                  cfg.extra_layers)  # before listing names
    held = sum(f.stat().st_size for f in folder.glob("*.safetensors") if f.is_file())
    weights_fit(cfg, str(cfg_path), "config.json's sizes", held, "its safetensors files'")  # before any store
    # the family's store: each mixture layer's experts stacked, its fused tensors read in parts, its cuts served
    store = Weights(of_config(cfg).store(cfg, store.store, str(folder)))
    cfg = _checked(cfg, store, str(folder), "config.json")
    return cfg, store.with_config(cfg)


MIN_BITS = 1  # the fewest bits a weight value takes in any format lanefuse reads is 2.625 (q2_k): a bound with room


def weights_fit(cfg: ModelConfig, where: str, sizes: str, held: int, holding: str) -> None:
    """Refuse a config whose sizes call for more weight values than the files could hold at MIN_BITS a value, before
    any store is built from them (an expert count or a state width of 10^9 would allocate its index tables first);
    the largest tensor those sizes ask for is named. Pure arithmetic on the config: nothing is allocated."""
    import math

    shapes = cfg.weight_names()
    total = sum(math.prod(s) for s in shapes.values())
    if total * MIN_BITS > 8 * max(held, 1):
        big = max(shapes, key=lambda n: math.prod(shapes[n]))
        raise UserError(f"{where}: {sizes} call for {total:,} weight values (tensor `{big}` alone {shapes[big]}), "
                        f"more than {holding} {held:,} bytes hold at {MIN_BITS} bit a value; a size is wrong")


def _checked(cfg: ModelConfig, store, where: str, whence: str, label=lambda name: name) -> ModelConfig:
    """`cfg` with each tensor's stored format, every tensor the step reads present in `store` with its shape;
    `label` names a tensor as the file does."""
    stored = set(store.names())
    formats = []
    for name, shape in _progress(list(cfg.weight_names().items()), "checking tensors"):
        if name not in stored:
            raise UserError(f"{where}: the checkpoint has no tensor `{label(name)}` (expected shape {shape})")
        got = store.shape(name)
        if got != shape:
            raise UserError(f"{where}: tensor `{label(name)}` has shape {got}, expected {shape} (from {whence})")
        formats.append((name, store.format(name)))
    return dataclasses.replace(cfg, formats=tuple(formats))


def _load_gguf(path: Path, max_len: int) -> tuple[ModelConfig, Weights]:
    from lanefuse.engine.front.gguf import load_gguf

    cfg, gstore = load_gguf(path, max_len)
    weights_fit(cfg, str(path), "the metadata's sizes", path.stat().st_size, "the file's")  # before any store
    gstore = of_config(cfg).gguf_store(cfg, gstore, str(path))  # the family's (engine/front/family.py)
    store = Weights(gstore)
    cfg = _checked(cfg, store, str(path), "the file's metadata", label=gstore.file_name)
    return cfg, store.with_config(cfg)
