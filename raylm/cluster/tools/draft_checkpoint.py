"""A draft model cut from a target checkpoint: its first layers, with the target's embeddings, final norm, LM head,
tokenizer and vocabulary. The cheapest draft that shares the target's vocabulary and much of its behaviour (the
early layers carry most of a small model's next-token guess), for speculative decoding's `draft_model` method."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def make_draft_checkpoint(target: Path | str, out: Path | str, num_layers: int) -> Path:
    """Write the first `num_layers` layers of `target` (a single-file safetensors checkpoint) to `out`."""
    target, out = Path(target), Path(out)
    config = json.loads((target / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{config['num_hidden_layers']} (the target's layers)")
    out.mkdir(parents=True, exist_ok=True)
    for file in target.iterdir():
        if file.is_file() and file.name not in ("config.json", "model.safetensors"):
            shutil.copy2(file, out / file.name)
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "mlp_only_layers"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(target / "model.safetensors")

    def kept(name: str) -> bool:
        match = _LAYER.match(name)
        return match is None or int(match.group(1)) < num_layers

    save_file({name: tensor for name, tensor in weights.items() if kept(name)}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out
