"""Where the model comes from: a local folder or .gguf file, object storage (s3://, gs://: copied into the user
cache), the Hugging Face cache or hub, or the default: SmolLM2-135M-Instruct where this machine has fetched it
(cluster.models.default_gguf), else the tiny random-weight model."""
from __future__ import annotations

import sys
from pathlib import Path

from raylm.cluster.models.default_gguf import DEFAULT_GGUF_NAME, default_gguf_path
from raylm.cluster.models.tiny_model import DEFAULT_MODEL_NAME, make_tiny_model
from raylm.common.object_storage import is_object_uri, local_copy
from raylm.configs import ModelConfig
from raylm.configs.gguf_metadata import is_gguf


def resolve_model(model_config: ModelConfig) -> ModelConfig:
    """`model_config` naming a local checkpoint folder or .gguf file (the default if none is named; a line on stderr
    says which) and its served name."""
    model = model_config.model
    if model is None:
        model = str(build_default_model())
        print(f"raylm: model: {describe_default_model(Path(model))}", file=sys.stderr, flush=True)
    elif is_object_uri(model):
        model = _object_storage_copy(model)
    elif not (Path(model).is_dir() or is_gguf(model)):
        model = _download(model)
    return model_config.model_copy(update={"model": model, "served_model_name": served_model_name(model_config)})


def served_model_name(model_config: ModelConfig) -> str:
    """The model id the API shows, known before the model is resolved: the setting, else the folder or file name
    or the hub id as given (a hub snapshot folder is named by its commit hash)."""
    if model_config.served_model_name is not None:
        return model_config.served_model_name
    if model_config.model is None:
        return DEFAULT_GGUF_NAME if default_gguf_path() is not None else DEFAULT_MODEL_NAME
    path = Path(model_config.model)
    return path.name if path.is_dir() or is_gguf(path) else model_config.model


def build_default_model() -> Path:
    """SmolLM2's GGUF file where fetched, else the tiny checkpoint, built once per machine into the user cache."""
    return default_gguf_path() or make_tiny_model()


def is_default_chat_model(model: str | Path) -> bool:
    """Whether `model` is the fetched SmolLM2, an instruct model that answers through its chat template."""
    path = default_gguf_path()
    return path is not None and Path(model) == path


def describe_default_model(path: Path) -> str:
    if is_default_chat_model(path):
        return f"{DEFAULT_GGUF_NAME} (Q4_1 GGUF, the default; {path})"
    return (f"{DEFAULT_MODEL_NAME}, the tiny random-weight default (its output is noise); scripts/bootstrap.sh "
            f"(or scripts/fetch_default_model.py) fetches {DEFAULT_GGUF_NAME}, which answers")


def _object_storage_copy(uri: str) -> str:
    """This node's copy of the checkpoint at `uri`; the workers copy it to theirs (ModelInfo.source)."""
    path = local_copy(uri, "model")
    if not ((path / "config.json").is_file() or is_gguf(path)):
        raise ValueError(f"model: {uri} is neither a Hugging Face checkpoint folder (no config.json under the prefix) "
                         f"nor a .gguf object; name the prefix that holds config.json and the weights, or the .gguf")
    return str(path)


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
