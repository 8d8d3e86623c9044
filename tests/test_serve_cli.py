"""`raylm serve --no-ray` as users run it: a subprocess that announces its URL, answers, and stops on SIGTERM."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_serve_no_ray(llama_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "raylm.cluster.entrypoints.cli", "serve", "--no-ray", "--config",
         "raylm/configs/tiny.yaml", "--model", str(llama_path), "--port", str(port), "--api-key", "sk-cli"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        announcement = server.stdout.readline()
        assert announcement == f"raylm: serving {llama_path.name} at http://127.0.0.1:{port}/v1\n"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-cli", max_retries=0)
        response = client.completions.create(model=llama_path.name, prompt="Hello", max_tokens=4,
                                             extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == 4
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == -signal.SIGTERM  # uvicorn re-raises it after a graceful shutdown
    finally:
        server.kill()
