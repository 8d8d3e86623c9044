"""A fleet on Ray Serve: two tiny models (Llama with LoRA on 2 replicas, Qwen2 on 1, saved as a sentence-transformers
embedding model) behind one OpenAI endpoint built from `llm_configs`. Each request reaches its model's replicas (the
answer is that model's offline LLM answer; Qwen2's /v1/embeddings transformers' hidden states pooled as its files say),
an adapter from dynamic_lora_loading_path is loaded on first use, /v1/models lists everything, an unknown model is a
404 naming the served ones, /metrics carries both models, and an adapter loaded at run time reaches both replicas and
a replica started after it, then is unloaded from all."""
from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
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

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.serve.app import build_app, start_serve
from raylm.cluster.serve.asgi_relay import RelayedRequest
from raylm.cluster.serve.lora_serve import REPLICA_HEADER
from raylm.cluster.serve.serve_router import request_text
from raylm.common.lora_request import LoRARequest
from tests.lora_utils import make_adapter
from tests.test_embeddings import assert_close, reference, with_pooling

FLEET_CONFIG = Path(__file__).resolve().parents[1] / "raylm" / "configs" / "serve-fleet-tiny.yaml"
PROMPT = [5, 9, 13]
MAX_TOKENS = 5
ENGINE = {"max_model_len": 128, "disable_log_stats": True}
LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def adapters(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """"sql" in the dynamic folder; "chat" elsewhere, for /v1/load_lora_adapter."""
    root = tmp_path_factory.mktemp("fleet-adapters")
    return {"sql": make_adapter(llama_path, root / "dynamic" / "sql", seed=21, r=8),
            "chat": make_adapter(llama_path, root / "chat", seed=22, r=4, target_modules=["q_proj", "v_proj"])}


@pytest.fixture(scope="module")
def embedder(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 as an embedding model: mean pooling, not normalised (not the defaults: the files are read)."""
    return with_pooling(checkpoints["qwen2"], tmp_path_factory.mktemp("fleet-embedder") / "qwen2", "mean_tokens",
                        normalize=False)


@pytest.fixture(scope="module")
def offline(checkpoints: dict[str, Path], adapters: dict[str, Path], embedder: Path) -> dict[str, str]:
    """Each model's (and adapter's) greedy answer to PROMPT from the offline LLM."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPT}
    llama = LLM(model=str(checkpoints["llama"]), **ENGINE, **LORA)
    loras = [None, LoRARequest("sql", 1, str(adapters["sql"])), LoRARequest("chat", 2, str(adapters["chat"]))]
    outputs = llama.generate([prompt] * 3, params, use_tqdm=False, lora_request=loras)
    llama.shutdown()
    qwen = LLM(model=str(embedder), **ENGINE)
    [qwen_output] = qwen.generate([prompt], params, use_tqdm=False)
    qwen.shutdown()
    answers = dict(zip(["llama", "sql", "chat"], (output.outputs[0].text for output in outputs)))
    return answers | {"qwen": qwen_output.outputs[0].text}


@pytest.fixture(scope="module")
def base_url(checkpoints: dict[str, Path], adapters: dict[str, Path], embedder: Path) -> Iterator[str]:
    """The app of serve-fleet-tiny.yaml, its two models the tiny Llama (2 replicas, LoRA) and Qwen2 (embedder)."""
    port = _free_port()  # not Serve's default 8000: other Serve tests may run on this machine
    lora_entry, plain_entry = yaml.safe_load(FLEET_CONFIG.read_text())["applications"][0]["args"]["llm_configs"]
    assert (lora_entry["enable_lora"], lora_entry["min_replicas"]) == (True, 2)
    llm_configs = [
        lora_entry | ENGINE | {"model": str(checkpoints["llama"]), "served_model_name": "llama",
                               "dynamic_lora_loading_path": str(adapters["sql"].parent)},
        plain_entry | ENGINE | {"model": str(embedder), "served_model_name": "qwen"},
    ]
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    try:
        start_serve("127.0.0.1", port)
        with pytest.MonkeyPatch.context() as patch:  # the opt-in, read where the app is built
            patch.setenv("RAYLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
            app = build_app({"llm_configs": llm_configs})
        serve.run(app, name="fleet", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def post(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, str, str | None]:
    """(status, body, the replica that answered)."""
    request = urllib.request.Request(base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode(), response.headers[REPLICA_HEADER]
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), err.headers[REPLICA_HEADER]


def complete(base_url: str, model: str) -> tuple[str, str]:
    """(the answer, the replica that gave it)."""
    status, body, replica = post(base_url, "/v1/completions", {"model": model, "prompt": PROMPT,
                                                                 "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                                 "ignore_eos": True})
    assert status == 200 and replica is not None, body
    return json.loads(body)["choices"][0]["text"], replica


def test_each_model_answers_through_the_openai_client(base_url: str, offline: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    for model in ("llama", "qwen", "sql"):  # "sql": loaded on first use from dynamic_lora_loading_path
        answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                           extra_body={"ignore_eos": True})
        assert (answer.model, answer.choices[0].text) == (model, offline[model])
    assert len({offline["llama"], offline["qwen"], offline["sql"]}) == 3  # the check tells the models apart
    stream = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3, stream=True)
    assert {chunk.model for chunk in stream} == {"qwen"}


def test_embeddings_beside_generation(base_url: str, embedder: Path, offline: dict[str, str]) -> None:
    """/v1/embeddings through the fleet: the Qwen2 replica pools as its sentence-transformers files say, while the
    Llama replicas generate."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    inputs = [PROMPT, list(range(40, 60))]
    embedded = client.embeddings.create(model="qwen", input=inputs, encoding_format="float")
    assert embedded.model == "qwen"
    for data, expected in zip(embedded.data, reference(embedder, inputs, "MEAN", False), strict=True):
        assert_close(data.embedding, expected)
    assert complete(base_url, "llama")[0] == offline["llama"]
    with pytest.raises(openai.NotFoundError, match="served: "):
        client.embeddings.create(model="nope", input=inputs)


def test_models_lists_every_model_and_adapter(base_url: str) -> None:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=60) as response:
        cards = {card["id"]: card["parent"] for card in json.loads(response.read())["data"]}
    assert cards == {"llama": None, "sql": "llama", "qwen": None}


def test_unknown_model_is_404_naming_the_served_ones(base_url: str) -> None:
    status, body, _ = post(base_url, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2})
    error = json.loads(body)["error"]
    assert status == 404 and error["param"] == "model"
    assert error["message"] == "The model `nope` does not exist; served: ['llama', 'qwen', 'sql']"


def test_metrics_are_labelled_by_model(base_url: str) -> None:
    """/metrics merges one replica's series per model (whichever Serve routes the call to), so every Llama replica
    has generated before the check: one request could reach one replica and the metrics call the other."""
    complete(base_url, "qwen")
    llama_replicas = set()
    for _ in range(32):  # Serve's router picks between the two at random
        llama_replicas.add(complete(base_url, "llama")[1])
        if len(llama_replicas) == 2:
            break
    assert len(llama_replicas) == 2, llama_replicas
    with urllib.request.urlopen(base_url + "/metrics", timeout=60) as response:
        families = {family.name: family for family in text_string_to_metric_families(response.read().decode())}
    tokens = families["vllm:generation_tokens"].samples
    assert {sample.labels["model_name"] for sample in tokens if sample.value > 0} == {"llama", "qwen"}


def _replicas_answering(base_url: str, model: str, expected: str, tries: int = 16) -> set[str]:
    """The replicas that answered `tries` requests for `model`, each answer checked."""
    replicas = set()
    for _ in range(tries):
        text, replica = complete(base_url, model)
        assert text == expected
        replicas.add(replica)
    return replicas


def _replicas_listing(adapter: str) -> list[bool]:
    """Whether each replica of the Llama deployment lists the adapter among its models."""
    handle = serve.get_deployment_handle("LLMServer:llama", "fleet")
    return [any(card.id == adapter for card in cards) for cards in handle.broadcast("model_cards").results()]


def test_runtime_adapter_reaches_every_replica(base_url: str, adapters: dict[str, Path],
                                               offline: dict[str, str]) -> None:
    status, body, _ = post(base_url, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(adapters["chat"])})
    assert status == 200, body
    assert _replicas_listing("chat") == [True, True]  # at once, not at a replica's next sync with the table
    time.sleep(2.0)  # each replica reports its adapters to Serve's controller, which tells the ingress's router
    # Serve's router picks between the replicas holding an adapter at random: both answer within 16 requests.
    first = _replicas_answering(base_url, "chat", offline["chat"])
    assert len(first) == 2
    status, body, _ = post(base_url, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/elsewhere"})
    assert status == 400 and "has already been loaded" in body

    # A replica started after the load (Serve replaces a killed one) loads it from its deployment's table.
    [victim] = [a["Pid"] for a in actors().values() if a["State"] == "ALIVE"
                and a["ActorClassName"].endswith("LLMServer:llama")][:1]
    os.kill(victim, signal.SIGKILL)
    deadline, replicas = time.monotonic() + 120, set(first)
    while time.monotonic() < deadline and replicas <= first:
        try:
            replicas |= _replicas_answering(base_url, "chat", offline["chat"], tries=4)
        except (AssertionError, OSError):  # requests that the dying replica had taken
            time.sleep(1.0)
    assert replicas - first, "no replica started after the load answered for the adapter"

    status, body, _ = post(base_url, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200, body
    assert _replicas_listing("chat") == [False, False]
    for _ in range(6):  # whichever replica Serve still counts it on
        status, body, _ = post(base_url, "/v1/completions", {"model": "chat", "prompt": PROMPT, "max_tokens": 2})
        assert status == 404, body
    assert complete(base_url, "llama")[0] == offline["llama"]


def test_bad_runtime_adapter_is_refused_everywhere(base_url: str, tmp_path: Path) -> None:
    status, body, _ = post(base_url, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(tmp_path)})
    assert status == 400 and json.loads(body)["error"]["param"] == "lora_path", body
    status, body, _ = post(base_url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "y", "model": "qwen"})
    assert status == 400 and "name one of ['llama']" in body
    status, body, _ = post(base_url, "/v1/unload_lora_adapter", {"lora_name": "broken"})
    assert status == 404, body


def test_each_model_is_a_deployment_of_its_own(base_url: str, checkpoints: dict[str, Path]) -> None:
    """A fleet built (not deployed) on the running Ray: each model's deployment has its own autoscaling range and
    placement group (the engine's bundle, then its workers': PP=2 one per stage, TP=2 one TP group) and LoRA."""
    app = build_app({"llm_configs": [
        {"model": str(checkpoints["llama"]), "served_model_name": "a", "enable_lora": True, "min_replicas": 1,
         "max_replicas": 3, "pipeline_parallel_size": 2, "distributed_executor_backend": "ray"},
        {"model": str(checkpoints["qwen2"]), "served_model_name": "b", "tensor_parallel_size": 2,
         "distributed_executor_backend": "ray"}]})
    ingress = app._bound_deployment
    built = {}
    for model in ingress.init_args[0]:
        deployment = model.server._bound_deployment
        autoscaling, replica = deployment._deployment_config.autoscaling_config, deployment._replica_config
        built[model.name] = (deployment.name, model.enable_lora, autoscaling.min_replicas, autoscaling.max_replicas,
                             replica.placement_group_bundles)
    assert built == {"a": ("LLMServer:a", True, 1, 3, [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]),
                     "b": ("LLMServer:b", False, 1, 1, [{"CPU": 1.0}, {"CPU": 2.0}])}


def test_fleet_settings_errors_name_the_field(llama_path: Path) -> None:
    with pytest.raises(ValueError, match=r"served_model_name must differ between models; got \['a', 'a'\]"):
        build_app({"llm_configs": [{"model": str(llama_path), "served_model_name": "a"}] * 2})
    with pytest.raises(ValueError, match="llm_configs: a non-empty list of engine settings"):
        build_app({"llm_configs": [], "model": str(llama_path)})
    with pytest.raises(ValueError, match="each entry is a dict of engine settings or a YAML path; got 3"):
        build_app({"llm_configs": [3]})


def test_relayed_requests_are_routed_by_their_prompt() -> None:
    """The fleet ingress relays requests as they came: the prefix router reads their prompt from the JSON body, and
    a conversation's next turn starts with the text of the turns before it."""
    def relayed(body: dict[str, Any]) -> RelayedRequest:
        return RelayedRequest("POST", "/v1/chat/completions", body=json.dumps(body).encode())

    turns = [{"role": "system", "content": "Be brief." * 20}, {"role": "user", "content": "Hi"}]
    first = request_text([relayed({"model": "m", "messages": turns})])
    second = request_text([relayed({"model": "m", "messages": [*turns, {"role": "assistant", "content": "Hello"},
                                                                 {"role": "user", "content": "Again"}]})])
    assert len(first) > 64 and second.startswith(first)
    assert request_text([relayed({"model": "m", "prompt": [5, 9, 13]})]) == "5,9,13"
    assert request_text([RelayedRequest("GET", "/v1/models")]) == ""
