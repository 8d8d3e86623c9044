"""The Ray Serve application from the serve-tiny.yaml preset on a local Ray, answered over HTTP: the OpenAI routes and
/metrics, and a replica whose worker dies replaced."""
from __future__ import annotations

import json
import os
import signal
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
from ray._private.state import actors
from ray.serve.context import _get_global_client

from raylm import LLM
from raylm.cluster.serve.app import (
    SERVE_ENV_VARS,
    LLMServer,
    build_app,
    llm_server_options,
    replica_deployment,
    replica_torch_threads,
    start_serve,
)
from raylm.configs import make_engine_config
from tests.test_error_statuses import assert_engine_failures_are_errors

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIG = REPO_ROOT / "raylm" / "configs" / "serve-tiny.yaml"


@pytest.fixture(scope="module")
def application() -> dict[str, Any]:
    return yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ray_metrics_port() -> int:
    """Where this module's Ray exports its metrics (what a Prometheus scraping the node reads)."""
    return _free_port()


@pytest.fixture(scope="module")
def base_url(application: dict[str, Any], llama_path: Path, ray_metrics_port: int) -> Iterator[str]:
    port = _free_port()
    # "local": a fresh Ray, never one that another process started on this machine. Metrics are reported every
    # 0.5 s instead of 10 s, so that the export test waits little.
    ray.init(address="local", num_cpus=4, include_dashboard=False, _metrics_export_port=ray_metrics_port,
             _system_config={"metrics_report_interval_ms": 500},
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    try:
        start_serve("127.0.0.1", port)
        app = build_app({**application["args"], "model": str(llama_path)})
        serve.run(app, name=application["name"], route_prefix=application["route_prefix"])
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_serve_config_builds_autoscaling_deployments(application: dict[str, Any]) -> None:
    assert application["import_path"] == "raylm.cluster.serve.app:build_app"
    settings = dict(application["args"])
    config = make_engine_config(settings.pop("config"), **settings)
    autoscaling = llm_server_options(config, replica_deployment(config))["autoscaling_config"]
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"]) == (1, 2)


def test_serve_config_gives_serve_raylm_settings() -> None:
    """`serve run raylm/configs/serve-tiny.yaml` starts Serve's controller and proxies as start_serve does."""
    controller_options = yaml.safe_load(SERVE_CONFIG.read_text())["controller_options"]
    assert controller_options == {"runtime_env": {"env_vars": SERVE_ENV_VARS}}


def test_replica_runs_at_nice_0() -> None:
    config = make_engine_config("raylm/configs/tiny.yaml")
    options = llm_server_options(config, replica_deployment(config))
    assert options["ray_actor_options"]["runtime_env"] == {"env_vars": {"RAY_worker_niceness": "0"}}


def test_serve_actors_get_raylm_settings(base_url: str, llama_path: Path) -> None:
    """start_serve's env reaches the proxy through the controller's runtime_env, and the replica keeps the driver's
    runtime_env (PYTHONPATH here) beside its own: all of them at nice 0, not Ray's 15."""
    alive = [a for a in actors().values() if a["State"] == "ALIVE"]
    [proxy] = [a["Pid"] for a in alive if a["ActorClassName"] == "ProxyActor"]
    [replica] = [a["Pid"] for a in alive if a["ActorClassName"].endswith(f"LLMServer:{llama_path.name}")]
    for pid in (proxy, replica):
        assert os.getpriority(os.PRIO_PROCESS, pid) == 0
    assert SERVE_ENV_VARS.items() <= _environ(proxy).items()
    assert _environ(replica)["PYTHONPATH"] == str(REPO_ROOT)


def test_a_replica_computes_on_every_core_unless_told(base_url: str) -> None:
    """Ray sets OMP_NUM_THREADS to an actor's num_cpus (a replica reserves 1); a CPU engine in the replica would then
    run on one core. OMP_NUM_THREADS in the environment the replica starts with (the app's runtime_env, or the
    node's) still sets the threads."""
    cores = len(os.sched_getaffinity(0))
    probe = ray.remote(num_cpus=1)(replica_torch_threads)
    assert ray.get(probe.remote()) == cores
    assert ray.get(probe.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote()) == 1


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().decode().split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def test_stream_is_sse_through_the_grpc_proxy(base_url: str, llama_path: Path) -> None:
    """The raw body the client gets: one `data: {json}` event per token, the usage chunk, then [DONE]."""
    body = json.dumps({"model": llama_path.name, "prompt": "Once upon a time", "max_tokens": 5, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base_url}/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    assert text.endswith("\n\n")
    events = text.removesuffix("\n\n").split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert [len(chunk["choices"]) for chunk in chunks] == [1] * 5 + [0]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_answers_through_serve(base_url: str, application: dict[str, Any], llama_path: Path) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    model = llama_path.name
    assert [card.id for card in client.models.list()] == [model]

    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 8 and completion.choices[0].finish_reason == "length"

    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=0)

    # Embeddings through the ingress's handle to a replica, as the offline engine pools them.
    served = client.embeddings.create(model=model, input=["Hello there", "Once upon a time"]).data
    offline = LLM(model=str(llama_path), distributed_executor_backend="uni")
    try:
        expected = [output.outputs.embedding for output in offline.embed(["Hello there", "Once upon a time"])]
    finally:
        offline.shutdown()
    for got, want in zip(served, expected, strict=True):
        assert got.embedding == pytest.approx(want, abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="hi", dimensions=3)

    deployments = _get_global_client().get_serve_details()["applications"][application["name"]]["deployments"]
    autoscaling = deployments[f"LLMServer:{model}"]["deployment_config"]["autoscaling_config"]
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"]) == (1, 2)


def test_engine_failures_are_500s_and_error_events_through_serve(base_url: str, llama_path: Path) -> None:
    """What the engine fails is an error through Serve's proxy too, whole (a 500) and streamed (an error event)."""
    assert_engine_failures_are_errors(base_url, llama_path.name)


@pytest.mark.slow
def test_tp2_replica_runs_in_the_placement_group_serve_creates(base_url: str, llama_path: Path) -> None:
    app = build_app({"config": "raylm/configs/tiny.yaml", "model": str(llama_path), "served_model_name": "tp2",
                     "tensor_parallel_size": 2, "distributed_executor_backend": "ray"})
    serve.run(app, name="tp2", route_prefix="/tp2")
    try:
        client = openai.OpenAI(base_url=base_url.replace("/v1", "/tp2/v1"), api_key="unused", max_retries=0,
                               timeout=60)
        completion = client.completions.create(model="tp2", prompt="Once upon a time", max_tokens=4,
                                               extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 4
        # Serve's group for the replica, one bundle for it and one for its TP group; the executor made none.
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert [g["bundles"] for g in groups] == [{0: {"CPU": 1.0}, 1: {"CPU": 2.0}}]
    finally:
        serve.delete("tp2")


def _samples(url: str) -> list[Any]:
    """Every sample of the Prometheus text at `url`."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _metric_labels(base_url: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it has, from GET /metrics beside the /v1 routes."""
    samples: dict[str, list[dict[str, str]]] = {}
    for sample in _samples(base_url.removesuffix("/v1") + "/metrics"):
        samples.setdefault(sample.name, []).append(sample.labels)
    return samples


def test_metrics_through_serve(base_url: str, llama_path: Path) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    client.completions.create(model=llama_path.name, prompt="Once upon a time", max_tokens=4,
                              extra_body={"ignore_eos": True})
    samples = _metric_labels(base_url)
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                 "vllm:num_preemptions_total", "vllm:iteration_tokens_total_count", "vllm:cache_config_info"):
        assert name in samples, name
    # The cache settings as the engine resolved them, not as the app was built with them.
    assert samples["vllm:cache_config_info"][0]["attention_backend"] == "cpu"
    # The replica that answered labels its series with its id.
    replicas = {labels["replica"] for label_sets in samples.values() for labels in label_sets}
    assert len(replicas) == 1 and replicas <= _running_replica_ids(f"LLMServer:{llama_path.name}")


def _counter_by_replica(url: str, name: str) -> dict[str, float]:
    """Replica id -> the value of counter `name` (summed over its other labels) at `url`."""
    totals: dict[str, float] = {}
    for sample in _samples(url):
        if sample.name == name:
            totals[sample.labels["replica"]] = totals.get(sample.labels["replica"], 0.0) + sample.value
    return totals


def test_metrics_exported_through_ray(base_url: str, llama_path: Path, ray_metrics_port: int) -> None:
    """A replica's series reach Ray's metrics export (the node's Prometheus endpoint), renamed ray_vllm_*, with the
    values its own /metrics shows."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    client.completions.create(model=llama_path.name, prompt="Exported through Ray", max_tokens=3,
                              extra_body={"ignore_eos": True})
    own = _counter_by_replica(base_url.removesuffix("/v1") + "/metrics", "vllm:generation_tokens_total")
    (replica, generated), = own.items()
    assert generated >= 3
    ray_url = f"http://127.0.0.1:{ray_metrics_port}/metrics"
    deadline, exported = time.monotonic() + 60, {}
    while time.monotonic() < deadline and exported.get(replica) != generated:  # Ray reports every 0.5 s here
        time.sleep(0.5)
        exported = _counter_by_replica(ray_url, "ray_vllm_generation_tokens_total")
    assert exported.get(replica) == generated, exported
    wanted = {"ray_vllm_prompt_tokens_total", "ray_vllm_num_requests_running", "ray_vllm_kv_cache_usage_perc",
              "ray_vllm_time_to_first_token_seconds_count", "ray_vllm_request_success_total",
              "ray_vllm_cache_config_info"}
    names: set[str] = set()
    while time.monotonic() < deadline and not wanted <= names:  # each series arrives with its own report
        names = {sample.name for sample in _samples(ray_url)}
        time.sleep(0.5)
    assert wanted <= names, wanted - names


def _running_replica_ids(deployment: str) -> set[str]:
    applications = _get_global_client().get_serve_details()["applications"].values()
    return {replica["replica_id"] for app in applications for name, info in app["deployments"].items()
            if name == deployment for replica in info["replicas"] if replica["state"] == "RUNNING"}


@pytest.mark.slow
def test_replica_with_a_killed_worker_is_replaced(base_url: str, llama_path: Path) -> None:
    """A TP 2 replica's worker actor dies: the engine fails, Serve's health check (every second here) fails the
    replica, Serve starts another, and requests succeed again."""
    config = make_engine_config("raylm/configs/tiny.yaml", model=str(llama_path), served_model_name="recovery",
                                tensor_parallel_size=2, distributed_executor_backend="ray")
    options = llm_server_options(config, replica_deployment(config))
    options |= {"health_check_period_s": 1, "graceful_shutdown_timeout_s": 2}
    serve.run(serve.deployment(LLMServer).options(name="LLMServer:recovery", **options).bind(config),
              name="recovery", route_prefix="/recovery")
    try:
        url = base_url.replace("/v1", "/recovery/v1")
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)

        def complete() -> int:
            return client.completions.create(model="recovery", prompt="Once upon a time", max_tokens=4,
                                             extra_body={"ignore_eos": True}).usage.completion_tokens

        assert complete() == 4
        [replica_before] = {labels["replica"] for labels in _metric_labels(url)["vllm:num_requests_running"]}
        workers = [a for a in actors().values() if a["ActorClassName"] == "RayWorkerWrapper" and a["State"] == "ALIVE"]
        assert len(workers) == 2
        os.kill(workers[1]["Pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        while True:
            try:
                if complete() == 4:
                    break
            except openai.APIError:
                pass
            assert time.monotonic() - killed_at < 180, "no replica served again within 180 s"
            time.sleep(1)
        [replica_after] = {labels["replica"] for labels in _metric_labels(url)["vllm:num_requests_running"]}
        assert replica_after != replica_before
    finally:
        serve.delete("recovery")
