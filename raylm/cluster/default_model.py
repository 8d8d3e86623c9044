"""Where the model comes from: a local folder, the Hugging Face cache or hub, or the tiny default."""
from __future__ import annotations

from pathlib import Path

from raylm.cluster.tiny_model import DEFAULT_MODEL_NAME, make_tiny_model
from raylm.configs import ModelConfig


def resolve_model(model_config: ModelConfig) -> ModelConfig:
    """`model_config` naming a local checkpoint folder (the tiny default built if none is named) and its served
    name."""
    model = model_config.model
    if model is None:
        model = str(build_default_model())
    elif not Path(model).is_dir():
        model = _download(model)
    return model_config.model_copy(update={"model": model, "served_model_name": served_model_name(model_config)})


def served_model_name(model_config: ModelConfig) -> str:
    """The model id the API shows, known before the model is resolved: the setting, else the folder name
    or the hub id as given (a hub snapshot folder is named by its commit hash)."""
    if model_config.served_model_name is not None:
        return model_config.served_model_name
    if model_config.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model_config.model)
    return path.name if path.is_dir() else model_config.model


def build_default_model() -> Path:
    """The tiny default checkpoint, built once per machine into the user cache (RAYLM_CACHE_DIR)."""
    return make_tiny_model()


def _download(model_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
        try:
            return snapshot_download(model_id, allow_patterns=patterns, local_files_only=True)
        except Exception:
            return snapshot_download(model_id, allow_patterns=patterns)
    except Exception as err:
        raise ValueError(f"model: {model_id!r} is not a local folder and could not be fetched from the "
                         f"Hugging Face hub ({type(err).__name__}: {err})") from None
