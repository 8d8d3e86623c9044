"""A real HTTP server for the OpenAI app in tests: uvicorn in a background thread on a free port."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.entrypoints.openai.api_server import build_engine_app
from raylm.configs import make_engine_config

MAX_MODEL_LEN = 256


class Server:
    """uvicorn in a background thread, on a port the OS picks."""

    def __init__(self, app: FastAPI) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, "the server to start")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """Raw HTTP: (status, parsed JSON body, or the text when it is not JSON)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        payload = body if isinstance(body, bytes | None) else json.dumps(body).encode()
        conn.request(method, path, payload, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def engine_settings(model: Path) -> dict[str, Any]:
    return {"model": str(model), "max_model_len": MAX_MODEL_LEN, "block_size": 16, "num_gpu_blocks_override": 256,
            "max_num_seqs": 32, "max_num_batched_tokens": 1024, "distributed_executor_backend": "uni"}


@contextmanager
def served_engine(model: Path, **settings: Any) -> Iterator[tuple[Server, AsyncLLM]]:
    """The app over one engine (engine_settings, `settings` on top), served once the model is loaded."""
    app, engine = build_engine_app(make_engine_config(**{**engine_settings(model), **settings}))
    server = Server(app)
    try:
        wait_until(lambda: server.request("GET", "/health")[0] == 200, "the engine to load")
        yield server, engine
    finally:
        server.stop()  # the app's lifespan shuts the engine down


def metrics(server: Server) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, from GET /metrics."""
    status, text = server.request("GET", "/metrics")
    assert status == 200
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def metric(server: Server, name: str, model: str, engine: str = "0", **labels: str) -> float:
    return metrics(server)[(name, frozenset({"model_name": model, "engine": engine, **labels}.items()))]
