"""Where the model comes from: a local folder, the Hugging Face cache or hub, or the tiny default."""
from __future__ import annotations

from pathlib import Path

from configs import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "tiny-llama"


def resolve_model(model_config: ModelConfig) -> None:
    """Set `model_config.model` to a local checkpoint folder, building the tiny default if none is named."""
    if model_config.model is None:
        model_config.model = str(build_default_model())
    elif not Path(model_config.model).is_dir():
        model_config.model = _download(model_config.model)
    if model_config.served_model_name is None:
        model_config.served_model_name = Path(model_config.model).name


def build_default_model() -> Path:
    # scripts/ is not a layer: the builder is imported only when the default is needed.
    from scripts.make_tiny_model import make_tiny_model

    return make_tiny_model(DEFAULT_MODEL_DIR)


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
