"""The OpenAI HTTP app in operation: client disconnects free their KV blocks, /metrics counts what usage
reports (vLLM's request-level families included), the API key, and /health following the engine from loading to dead."""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import raylm.cluster.engine.async_llm
from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.engine.llm_engine import LLMEngine
from raylm.cluster.entrypoints.openai.api_server import build_app, build_engine_app
from raylm.cluster.entrypoints.openai.router import EngineModelRouter
from raylm.configs import make_engine_config
from tests.http_server import Server, engine_settings, metric, metrics, served_engine, wait_until

API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def served(llama_path: Path) -> Iterator[tuple[Server, AsyncLLM]]:
    with served_engine(llama_path) as served:
        yield served


@pytest.fixture(scope="module")
def server(served: tuple[Server, AsyncLLM]) -> Server:
    return served[0]


@pytest.fixture(scope="module")
def engine(served: tuple[Server, AsyncLLM]) -> AsyncLLM:
    return served[1]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _send_raw(sock: socket.socket, path: str, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(payload), payload))


def test_disconnect_mid_stream_frees_blocks(server: Server, engine: AsyncLLM, llama_path: Path) -> None:
    model = llama_path.name
    aborted_before = metric(server, "vllm:request_success_total", model, finished_reason="abort")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        _send_raw(sock, "/v1/completions", {"prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True})
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
        wait_until(lambda: metric(server, "vllm:kv_cache_usage_perc", model) > 0, "KV blocks in use")
        assert metric(server, "vllm:num_requests_running", model) == 1
    wait_until(lambda: metric(server, "vllm:kv_cache_usage_perc", model) == 0.0, "the blocks to be freed", 10)
    assert engine.scheduler_stats.num_running_reqs == 0
    assert metric(server, "vllm:request_success_total", model, finished_reason="abort") == aborted_before + 1


def test_disconnect_while_waiting_for_whole_response(server: Server, llama_path: Path) -> None:
    model = llama_path.name
    aborted_before = metric(server, "vllm:request_success_total", model, finished_reason="abort")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        _send_raw(sock, "/v1/completions", {"prompt": "Once", "max_tokens": 200, "ignore_eos": True})
        wait_until(lambda: metric(server, "vllm:kv_cache_usage_perc", model) > 0, "KV blocks in use")
    wait_until(lambda: metric(server, "vllm:request_success_total", model, finished_reason="abort")
                == aborted_before + 1, "the request to be aborted", 10)
    assert metric(server, "vllm:kv_cache_usage_perc", model) == 0.0


def test_metrics_count_what_usage_reports(server: Server, client: openai.OpenAI, engine: AsyncLLM,
                                          llama_path: Path) -> None:
    model = llama_path.name
    before = metrics(server)
    stats_line_before = engine.scheduler_stats.num_prompt_tokens
    response = client.completions.create(model=model, prompt="Counting tokens here", max_tokens=7,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    after = metrics(server)
    label = frozenset({"model_name": model, "engine": "0"}.items())

    def delta(name: str, labels: frozenset = label) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)  # a histogram shows from its first sample

    assert delta("vllm:prompt_tokens_total") == response.usage.prompt_tokens
    # The stats line's prompt throughput counts the same tokens.
    assert engine.scheduler_stats.num_prompt_tokens - stats_line_before == response.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == response.usage.completion_tokens == 7
    assert delta("vllm:request_success_total", label | {("finished_reason", "length")}) == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:prefix_cache_queries_total") == response.usage.prompt_tokens
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after[(gauge, label)] == 0
    assert ("vllm:prefix_cache_hits_total", label) in after

    # vLLM's request-level families: one observation each; queue, prefill and decode time add up to e2e latency.
    for name in ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds", "inference_time_seconds",
                 "prompt_tokens", "generation_tokens"):
        assert delta(f"vllm:request_{name}_count") == 1
    assert delta("vllm:request_prompt_tokens_sum") == response.usage.prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == 7
    assert delta("vllm:iteration_tokens_total_sum") == response.usage.prompt_tokens + 7
    assert delta("vllm:request_queue_time_seconds_sum") + delta("vllm:request_inference_time_seconds_sum") == \
        pytest.approx(delta("vllm:e2e_request_latency_seconds_sum"))
    assert delta("vllm:num_preemptions_total") == 0
    [cache_info] = [dict(labels) for name, labels in after if name == "vllm:cache_config_info"]
    assert cache_info["block_size"] == "16" and cache_info["engine"] == "0"


def test_api_key(engine: AsyncLLM, llama_path: Path) -> None:
    secured = Server(build_app(EngineModelRouter(engine), api_key=API_KEY))
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        status, error = secured.request("POST", "/v1/completions", body)
        assert status == 401 and error["error"]["type"] == "authentication_error"
        assert secured.request("POST", "/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
        assert secured.request("GET", "/health")[0] == 200
        client = openai.OpenAI(base_url=secured.base_url, api_key=API_KEY, max_retries=0)
        assert client.completions.create(model=llama_path.name, prompt="hi", max_tokens=2).usage.completion_tokens
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=secured.base_url, api_key="wrong", max_retries=0).models.list()
    finally:
        secured.stop()


def test_health_follows_the_engine(llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """503 while the model loads, 200 once it is up; a stream in flight when the engine dies ends with an
    in-band error, and everything after answers 503."""
    loading = threading.Event()

    class SlowLoadingEngine(LLMEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            loading.wait()
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(raylm.cluster.engine.async_llm, "LLMEngine", SlowLoadingEngine)
    app, engine = build_engine_app(make_engine_config(**engine_settings(llama_path)))
    server = Server(app)
    try:
        status, body = server.request("GET", "/health")
        assert status == 503 and body["error"]["code"] == 503
        loading.set()
        wait_until(lambda: server.request("GET", "/health")[0] == 200, "the engine to load")

        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        stream = client.completions.create(model=llama_path.name, prompt="Once", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        engine.shutdown()
        with pytest.raises(openai.APIError, match="shut down"):
            list(stream)
        assert server.request("GET", "/health")[0] == 503
        status, body = server.request("POST", "/v1/completions", {"prompt": "hi"})
        assert status == 503 and body["error"]["type"] == "service_unavailable_error"
    finally:
        loading.set()
        server.stop()
