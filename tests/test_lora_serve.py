"""LoRA under Ray Serve on a local Ray with two replicas: the ingress reads each request's `model`, Serve's
multiplexed routing sends every request for an adapter to the replica that loaded it (from
dynamic_lora_loading_path, on demand), and a second adapter goes to the other replica (max_loras=1 each). Without
the run-time opt-in where the app is built, no adapter is loaded over HTTP, even where the replicas' environment has
it."""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import serve

from raylm.cluster.serve.app import build_app, start_serve
from raylm.cluster.serve.lora_serve import REPLICA_HEADER
from tests.lora_utils import make_adapter


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    adapters = tmp_path_factory.mktemp("serve-adapters")
    make_adapter(llama_path, adapters / "sql", seed=21, r=8)
    make_adapter(llama_path, adapters / "chat", seed=22, r=4, target_modules=["q_proj", "v_proj"])
    port = _free_port()  # not Serve's default 8000: other Serve tests may run on this machine
    # The replicas' environment opts in to run-time adapters; this process, where the app is built, does not.
    ray.init(address="local", num_cpus=8, include_dashboard=False,
             runtime_env={"env_vars": {"RAYLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}})
    try:
        start_serve("127.0.0.1", port)
        app = build_app({"model": str(llama_path), "served_model_name": "base", "enable_lora": True, "max_loras": 1,
                         "max_lora_rank": 8, "dynamic_lora_loading_path": str(adapters), "min_replicas": 2,
                         "max_replicas": 2, "max_model_len": 128, "disable_log_stats": True})
        serve.run(app, name="lora", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def post(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    """(status, JSON body, the replica that answered)."""
    request = urllib.request.Request(base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), response.headers[REPLICA_HEADER]
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers[REPLICA_HEADER]


def complete(base_url: str, model: str) -> tuple[str, str]:
    status, body, replica = post(base_url, "/v1/completions", {"model": model, "prompt": [5, 9, 13], "max_tokens": 5,
                                                                 "temperature": 0.0, "ignore_eos": True})
    assert status == 200, body
    return body["choices"][0]["text"], replica


def test_models_are_listed_through_the_ingress(base_url: str) -> None:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=60) as response:
        cards = {card["id"]: card["parent"] for card in json.loads(response.read())["data"]}
    assert cards == {"base": None, "sql": "base", "chat": "base"}


def test_requests_for_an_adapter_go_to_the_replica_holding_it(base_url: str) -> None:
    sql_text, sql_replica = complete(base_url, "sql")
    time.sleep(2.0)  # the replica reports its adapters to Serve's controller, which tells the routers
    answers = [complete(base_url, "sql") for _ in range(6)]
    assert answers == [(sql_text, sql_replica)] * 6
    # The other replica holds no adapter: the second adapter goes there, and stays there.
    chat_text, chat_replica = complete(base_url, "chat")
    assert chat_replica != sql_replica
    time.sleep(2.0)
    assert [complete(base_url, "chat") for _ in range(4)] == [(chat_text, chat_replica)] * 4
    assert complete(base_url, "sql") == (sql_text, sql_replica)
    base_text, _ = complete(base_url, "base")
    assert len({base_text, sql_text, chat_text}) == 3


def test_unknown_adapter_is_404(base_url: str) -> None:
    status, body, _ = post(base_url, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and "The model `nope` does not exist" in body["error"]["message"]


def test_runtime_adapters_need_the_opt_in_where_the_app_is_built(base_url: str, llama_path: Path,
                                                                  tmp_path: Path) -> None:
    """As on `--no-ray`, the routes are not there (404) without the opt-in where the app is built; replicas never
    answer them, whatever their environment, since a load must reach all of them."""
    extra = make_adapter(llama_path, tmp_path / "extra", seed=23, r=4)
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": str(extra)}),
                       ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
        status, answer, _ = post(base_url, path, body)
        assert status == 404 and answer["error"]["message"] == "Not Found", answer
    with urllib.request.urlopen(base_url + "/v1/models", timeout=60) as response:
        assert "extra" not in {card["id"] for card in json.loads(response.read())["data"]}


def test_prefix_routing_over_replicas_is_refused_with_lora(llama_path: Path) -> None:
    # Two ingresses cannot both pick the replica: with enable_lora, Serve's multiplexing picks it by adapter.
    with pytest.raises(ValueError, match="routing_policy 'prefix' over Serve replicas cannot be combined with "
                                         "enable_lora"):
        build_app({"model": str(llama_path), "enable_lora": True, "max_replicas": 2, "routing_policy": "prefix"})
