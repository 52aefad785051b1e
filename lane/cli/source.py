"""What a MODEL argument names: the built-in demo model (none given), a checkpoint folder, or a step YAML."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lanefuse.engine.errors import UserError
from lanefuse.engine.ir import Graph
from lanefuse.engine.model import ModelConfig, build_step


@dataclass
class Source:
    name: str
    cfg: ModelConfig | None  # None for a step YAML without a model behind it
    weights: object | None
    step: Graph | None = None  # a step YAML's own graph
    path: str | None = None

    def graph(self, rows: int = 1) -> Graph:
        if self.step is not None:
            if rows != int(self.step.meta.get("rows", 1)):
                raise UserError(f"{self.name}: the step YAML is a step of {self.step.meta.get('rows', 1)} rows, "
                                f"not {rows}")
            return self.step
        assert self.cfg is not None
        return build_step(self.cfg, rows)


def open_model(model: str | None, progress: bool = False) -> Source:
    """Resolve MODEL: nothing -> the demo model; a folder -> an HF checkpoint; a .yaml/.yml file -> a step YAML."""
    if model is None or model == "demo":
        from lanefuse.engine.demo import demo_model

        cfg, weights = demo_model()
        return Source("demo", cfg, weights)
    if not os.path.exists(model):
        raise UserError(f"{model}: no such file or folder (give a checkpoint folder, a step YAML, or nothing for "
                        f"the demo model)")
    if os.path.isdir(model):
        from lanefuse.engine.front import load_model

        cfg, weights = load_model(model)  # its progress bar shows where stderr is a terminal
        return Source(os.path.basename(os.path.normpath(model)), cfg, weights, path=model)
    if model.endswith((".yaml", ".yml")):
        from lanefuse.engine.stepweights import step_weights
        from lanefuse.engine.stepyaml import from_yaml

        from lanefuse.engine.yamlsafe import read_text

        g = from_yaml(read_text(model), source=model)  # unreadable or not UTF-8: a UserError naming the file
        weights = step_weights(g, base=os.path.dirname(os.path.abspath(model))) if g.meta.get("weights") else None
        return Source(os.path.basename(model), None, weights, step=g, path=model)
    if model.endswith(".gguf"):
        raise UserError(f"{model}: GGUF checkpoints are not supported yet (give a safetensors checkpoint folder)")
    raise UserError(f"{model}: not a checkpoint folder or a step YAML (.yaml)")
