"""Tiny checkpoints for the rope-scaling and sliding-window tests: weights drawn wide enough for the rotary frequencies
(or a window, or a soft-cap) to decide greedy tokens, and copies with a changed config.json."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def widen_weights(path: Path, seed: int = 0) -> None:
    """Re-draw the weights wider than the default init (norms around 1; Gemma's, which scale by 1 + weight, around 2),
    so that attention is sharp enough for the rotary frequencies, a window or a cap to show in the greedy tokens."""
    torch.manual_seed(seed)
    weights = {name: torch.empty_like(w).uniform_(0.5, 1.5) if "norm" in name else torch.randn_like(w) * 0.1
               for name, w in load_file(path / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def with_config(source: Path, out: Path, **changes: Any) -> Path:
    """A copy of checkpoint `source` whose config.json (and its rope_parameters) takes `changes`."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config.update({k: v for k, v in changes.items() if k != "rope_parameters"})
    config["rope_parameters"].update(changes.get("rope_parameters", {}))
    (out / "config.json").write_text(json.dumps(config))
    return out
