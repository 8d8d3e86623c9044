"""Ray Serve across engines, over HTTP on a port of its own: the disaggregated prefill/decode app from
serve-pd-tiny.yaml (a prefill and a decode deployment, each autoscaled on its own, behind one OpenAI proxy) answers
as a colocated engine does, greedy, streamed or not; and an app of two replicas routed by prefix
(PrefixAwareRequestRouter on the LLMServer deployment, behind the OpenAI ingress) keeps each conversation on one
replica."""
from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.context import _get_global_client

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.serve.app import build_app, start_serve
from raylm.cluster.serve.serve_pd import build_pd_openai_app, pd_engine_config

REPO_ROOT = Path(__file__).resolve().parents[1]
PD_CONFIG = REPO_ROOT / "raylm" / "configs" / "serve-pd-tiny.yaml"
PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog, and then the dog", "Hi"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ray_metrics_port() -> int:
    return _free_port()


@pytest.fixture(scope="module")
def http_url(llama_path: Path, ray_metrics_port: int) -> Iterator[str]:
    port = _free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False, _metrics_export_port=ray_metrics_port,
             _system_config={"metrics_report_interval_ms": 500},
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    try:
        start_serve("127.0.0.1", port)
        application = yaml.safe_load(PD_CONFIG.read_text())["applications"][0]
        args = {side: {**settings, "model": str(llama_path)} for side, settings in application["args"].items()}
        routed = build_app({"config": "raylm/configs/tiny.yaml", "model": str(llama_path),
                            "served_model_name": "routed", "min_replicas": 2, "max_replicas": 2})
        # Both apps at once: their replicas start side by side instead of one app after the other.
        serve.run_many([serve.RunTarget(build_pd_openai_app(args), name="pd", route_prefix="/pd"),
                        serve.RunTarget(routed, name="routed", route_prefix="/routed")])
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def colocated(llama_path: Path, http_url: str) -> Iterator[LLM]:
    llm = LLM(config_file="raylm/configs/tiny.yaml", model=str(llama_path))
    yield llm
    llm.shutdown()


def test_pd_sides_take_their_roles_and_scale_apart() -> None:
    application = yaml.safe_load(PD_CONFIG.read_text())["applications"][0]
    assert application["import_path"] == "raylm.cluster.serve.serve_pd:build_pd_openai_app"
    prefill = pd_engine_config(application["args"], "prefill_config")
    decode = pd_engine_config(application["args"], "decode_config")
    assert (prefill.kv_transfer_config.kv_connector, prefill.kv_transfer_config.kv_role) == (
        "RayKVConnector", "kv_producer")
    assert decode.kv_transfer_config.kv_role == "kv_consumer"
    with pytest.raises(ValueError, match="prefill_config.kv_role"):
        pd_engine_config({"prefill_config": {"kv_connector": "RayKVConnector", "kv_role": "kv_consumer"}},
                         "prefill_config")


def test_pd_app_answers_as_a_colocated_engine(http_url: str, llama_path: Path, colocated: LLM) -> None:
    client = openai.OpenAI(base_url=f"{http_url}/pd/v1", api_key="unused", max_retries=0, timeout=120)
    model = llama_path.name
    expected = colocated.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                  use_tqdm=False)
    for prompt, reference in zip(PROMPTS, expected):
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                                               extra_body={"ignore_eos": True})
        assert completion.choices[0].text == reference.outputs[0].text
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == reference.outputs[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=6, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    # Both sides served: the prefill side one token per request (7 of them), the decode side the answers.
    deployments = _get_global_client().get_serve_details()["applications"]["pd"]["deployments"]
    for side, replicas in (("prefill", 2), ("decode", 2)):
        autoscaling = deployments[f"LLMServer:{side}:{model}"]["deployment_config"]["autoscaling_config"]
        assert (autoscaling["min_replicas"], autoscaling["max_replicas"]) == (1, replicas)
    generated = {side: _generated(serve.get_deployment_handle(f"LLMServer:{side}:{model}", "pd"))
                 for side in ("prefill", "decode")}
    assert generated == {"prefill": 7.0, "decode": 6 * 12 + 6.0}, generated


def _generated(handle: Any) -> float:
    text = handle.metrics_text.remote().result().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "vllm:generation_tokens_total")


def test_prefix_routing_keeps_a_conversation_on_one_replica(http_url: str, ray_metrics_port: int) -> None:
    details = _get_global_client().get_serve_details()["applications"]["routed"]["deployments"]
    router = details["LLMServer:routed"]["deployment_config"]["request_router_config"]["request_router_class"]
    assert "PrefixAwareRequestRouter" in router
    client = openai.OpenAI(base_url=f"{http_url}/routed/v1", api_key="unused", max_retries=0, timeout=120)
    for name in ("first", "second"):  # one after the other, so the loads are even
        messages = [{"role": "user", "content": f"Tell me about the {name} conversation, " * 6}]
        for _ in range(3):
            answer = client.chat.completions.create(model="routed", messages=messages, max_tokens=8,
                                                    temperature=0.0, extra_body={"ignore_eos": True})
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": "Go on, please."}]
    # The first conversation's turns all went to one replica, the second's (no match) to the other.
    deadline, per_replica = time.monotonic() + 60, {}
    while time.monotonic() < deadline and sorted(per_replica.values()) != [3.0, 3.0]:
        time.sleep(0.5)
        per_replica = _successes_by_replica(f"http://127.0.0.1:{ray_metrics_port}/metrics", "routed")
    assert sorted(per_replica.values()) == [3.0, 3.0], per_replica
    # The routers share one index actor; without it they route by load, and requests still succeed.
    ray.kill(ray.get_actor("raylm-prefix-index:routed:LLMServer:routed", namespace="serve"))
    answer = client.chat.completions.create(model="routed", messages=messages, max_tokens=2, temperature=0.0)
    assert answer.choices[0].message.content


def _successes_by_replica(url: str, model: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ray_vllm_request_success_total" and sample.labels.get("model_name") == model:
                replica = sample.labels["replica"]
                totals[replica] = totals.get(replica, 0.0) + sample.value
    return totals
