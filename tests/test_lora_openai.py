"""LoRA adapters over the OpenAI HTTP API: an adapter is a model (listed with its parent, chosen by `model`), loaded at
start-up, on demand from dynamic_lora_loading_path, or by /v1/load_lora_adapter; unloaded by /v1/unload_lora_adapter;
bad adapters and unknown names are clear 4xx answers that leave the loaded adapters serving."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from transformers import AutoTokenizer

from raylm.cluster.entrypoints.openai.api_server import build_engine_app
from raylm.cluster.entrypoints.openai.lora_endpoints import include_lora_endpoints
from raylm.configs import make_engine_config
from tests.http_server import Server, engine_settings, wait_until
from tests.lora_utils import make_adapter, peft_greedy

PROMPT = [5, 17, 33, 200, 41]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-adapters")
    dynamic = root / "dynamic"
    dynamic.mkdir()
    return {
        "static": make_adapter(llama_path, root / "static", seed=11, r=8),
        "runtime": make_adapter(llama_path, root / "runtime", seed=12, r=4, target_modules=["q_proj", "v_proj"]),
        "dyn": make_adapter(llama_path, dynamic / "dyn", seed=13, r=8, target_modules=["gate_proj", "up_proj"]),
        "big": make_adapter(llama_path, root / "big", seed=14, r=16),
        "dynamic": dynamic,
    }


@pytest.fixture(scope="module")
def server(llama_path: Path, adapters: dict[str, Path]) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        settings = engine_settings(llama_path) | dict(
            enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules=[f"static={adapters['static']}"],
            dynamic_lora_loading_path=str(adapters["dynamic"]), served_model_name="base")
        app, _ = build_engine_app(make_engine_config(**settings))
    server = Server(app)
    try:
        wait_until(lambda: server.request("GET", "/health")[0] == 200, "the engine to load")
        yield server
    finally:
        server.stop()


def matches_peft(body: dict[str, Any], llama_path: Path, adapter: Path | None) -> bool:
    """The response's tokens are PEFT's greedy ones: each token's text and logprob (the tiny tokenizer's byte tokens
    make the joined text a poor witness)."""
    ((tokens, tops),) = peft_greedy(llama_path, adapter, [PROMPT], MAX_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    logprobs = body["choices"][0]["logprobs"]
    return (logprobs["tokens"] == [tokenizer.decode([t]) for t in tokens]
            and all(abs(ours - top[t]) < 1e-3 for ours, top, t in zip(logprobs["token_logprobs"], tops, tokens)))


def complete(server: Server, model: str) -> tuple[int, Any]:
    return server.request("POST", "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0.0, "ignore_eos": True, "logprobs": 0})


def model_ids(server: Server) -> dict[str, str | None]:
    status, body = server.request("GET", "/v1/models")
    assert status == 200
    return {card["id"]: card["parent"] for card in body["data"]}


def test_adapters_are_models(server: Server, llama_path: Path, adapters: dict[str, Path]) -> None:
    assert model_ids(server) == {"base": None, "static": "base", "dyn": "base"}
    for model, adapter in (("base", None), ("static", adapters["static"])):
        status, body = complete(server, model)
        assert status == 200, body
        assert body["model"] == model and matches_peft(body, llama_path, adapter)
    status, body = complete(server, "nope")
    assert status == 404 and "The model `nope` does not exist" in body["error"]["message"]
    # Found in dynamic_lora_loading_path: loaded by the request that names it.
    status, body = complete(server, "dyn")
    assert status == 200 and matches_peft(body, llama_path, adapters["dyn"])
    status, body = server.request("POST", "/v1/chat/completions", {
        "model": "dyn", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert status == 200 and body["model"] == "dyn"


def test_load_and_unload_over_http(server: Server, llama_path: Path, adapters: dict[str, Path]) -> None:
    load = {"lora_name": "runtime", "lora_path": str(adapters["runtime"])}
    status, text = server.request("POST", "/v1/load_lora_adapter", load)
    assert status == 200 and "added successfully" in text
    assert model_ids(server)["runtime"] == "base"
    status, body = complete(server, "runtime")
    assert status == 200 and matches_peft(body, llama_path, adapters["runtime"])
    status, body = server.request("POST", "/v1/load_lora_adapter", load)
    assert status == 400 and "has already been loaded" in body["error"]["message"]
    refused = {
        "over max_lora_rank (8)": {"lora_name": "big", "lora_path": str(adapters["big"])},
        "not a PEFT adapter folder": {"lora_name": "none", "lora_path": "/nonexistent"},
        "the name is the base model's": {"lora_name": "base", "lora_path": str(adapters["runtime"])},
    }
    for message, request in refused.items():
        status, body = server.request("POST", "/v1/load_lora_adapter", request)
        assert status == 400 and message in body["error"]["message"], body
    assert server.request("POST", "/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400  # no lora_path
    status, text = server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "runtime"})
    assert status == 200 and "removed successfully" in text
    assert complete(server, "runtime")[0] == 404
    status, body = server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "runtime"})
    assert status == 404 and "cannot be found" in body["error"]["message"]
    # Nothing the refusals touched broke what was loaded.
    status, body = complete(server, "static")
    assert status == 200 and matches_peft(body, llama_path, adapters["static"])


def test_runtime_updates_need_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default (the routes do not exist); vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING turns them on too."""
    from fastapi.testclient import TestClient

    for name in ("RAYLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    app = FastAPI()
    include_lora_endpoints(app, None, [])  # type: ignore[arg-type]
    assert TestClient(app).post("/v1/load_lora_adapter", json={}).status_code == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    app = FastAPI()
    include_lora_endpoints(app, None, [])  # type: ignore[arg-type]
    assert TestClient(app).post("/v1/load_lora_adapter", json={}).status_code == 422  # the route, missing fields


def test_dynamic_folder_names_only_subfolders(tmp_path: Path, adapters: dict[str, Path]) -> None:
    from raylm.cluster.engine.lora_registry import LoRARegistry
    from raylm.configs.engine_config import LoRAConfig

    shutil.copytree(adapters["dyn"], tmp_path / "a")
    registry = LoRARegistry(LoRAConfig(enable_lora=True, dynamic_lora_loading_path=str(tmp_path)), "base")
    assert registry.dynamic_names() == ["a"] and registry.dynamic_folder("a") == tmp_path / "a"
    assert registry.dynamic_folder("../a") is None and registry.dynamic_folder("b") is None
