"""The pooler of an embedding model (vLLM's PoolerConfig): how a pooling request's hidden states become one vector.
The checkpoint says it the sentence-transformers way (`modules.json` naming a Pooling module, whose folder's
`config.json` names the pooling mode, and a Normalize module when the vectors are normalised); the `pooler_config`
setting overrides it field by field."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# vLLM's pooling types: the last token's hidden state (decoder embedding models), the mean over the prompt, or the
# first token's (the CLS token of encoder-style checkpoints).
PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[PoolingType, ...] = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes (1_Pooling/config.json) -> vLLM's pooling types.
_ST_POOLING_MODES: dict[str, PoolingType] = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


class PoolerConfig(BaseModel):
    """vLLM's pooler_config, given whole (a mapping in YAML and keywords, JSON on the command line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pooling_type: PoolingType | None = Field(
        None, description="LAST, MEAN or CLS; None: the checkpoint's sentence-transformers Pooling module, else LAST")
    normalize: bool | None = Field(
        None, description="L2-normalise embeddings; None: whether the checkpoint has a sentence-transformers "
                          "Normalize module (True when it has no modules.json)")


def resolve_pooler_config(override: PoolerConfig | None, model_path: str) -> PoolerConfig:
    """The model's pooler: `override`'s fields where set, else the checkpoint's sentence-transformers config, else
    vLLM's defaults for a decoder embedding model (LAST, normalised)."""
    checkpoint = read_sentence_transformers_pooling(Path(model_path))
    pooling_type = override.pooling_type if override and override.pooling_type else checkpoint.get("pooling_type")
    if pooling_type is None and "unsupported" in checkpoint:
        raise ValueError(f"{checkpoint['unsupported']}: raylm pools with one of {sorted(_ST_POOLING_MODES)}; set "
                         f"pooler_config's pooling_type (LAST, MEAN or CLS) to choose one")
    normalize = override.normalize if override and override.normalize is not None else checkpoint.get("normalize")
    return PoolerConfig(pooling_type=pooling_type or "LAST", normalize=True if normalize is None else normalize)


def read_sentence_transformers_pooling(path: Path) -> dict[str, Any]:
    """{"pooling_type", "normalize"} as far as the checkpoint folder's modules.json says (empty without one);
    "unsupported" says which pooling modes it names that raylm does not pool with (several, or max, weighted mean)."""
    modules_file = path / "modules.json"
    if not path.is_dir() or not modules_file.exists():
        return {}
    modules = json.loads(modules_file.read_text())
    found: dict[str, Any] = {"normalize": any(m.get("type") == _ST_NORMALIZE for m in modules)}
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is not None:
        config_file = path / pooling.get("path", "") / "config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        chosen = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value is True)
        if len(chosen) == 1 and chosen[0] in _ST_POOLING_MODES:
            found["pooling_type"] = _ST_POOLING_MODES[chosen[0]]
        elif chosen:
            found["unsupported"] = f"{config_file} names the pooling modes {chosen}"
    return found
