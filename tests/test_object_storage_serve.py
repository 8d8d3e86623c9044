"""Ray Serve from object storage: two replicas on one node serve a model from the test's S3 server (moto's; s3fs
unmocked) with one download: both replicas' resolutions and their Ray worker actors share the node's copy. An adapter
is found on demand under an s3:// dynamic_lora_loading_path and copied by the replica that serves it."""
from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import ray
from ray import serve
from ray._private.state import actors

from raylm.cluster.serve.app import build_app, start_serve
from tests.lora_utils import make_adapter
from tests.s3_server import BUCKET, S3, cache_fixture, copy_root, s3_fixture  # noqa: F401  (the fixtures)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.loads(response.read()))


def test_two_replicas_on_one_node_download_once(s3: S3, llama_path: Path, tmp_path: Path) -> None:
    uri = s3.upload(llama_path, "tiny-llama")
    adapter = s3.upload(make_adapter(llama_path, tmp_path / "sql", seed=21, r=8), "serve-adapters/sql")
    port = _free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False)  # its raylet has the s3 fixture's AWS_* variables
    try:
        start_serve("127.0.0.1", port)
        serve.run(build_app({
            "model": uri, "served_model_name": "base", "enable_lora": True, "max_lora_rank": 8,
            "dynamic_lora_loading_path": f"s3://{BUCKET}/serve-adapters", "min_replicas": 2, "max_replicas": 2,
            "distributed_executor_backend": "ray", "max_model_len": 128, "disable_log_stats": True}),
            name="s3", route_prefix="/")
        for model in ("base", "sql"):
            body = _post(f"http://127.0.0.1:{port}/v1/completions", {
                "model": model, "prompt": [5, 9, 13], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True})
            assert body["model"] == model
        workers = [a for a in actors().values() if a["ActorClassName"] == "RayWorkerWrapper" and a["State"] == "ALIVE"]
        assert len(workers) == 2  # one per replica, on this node
    finally:
        serve.shutdown()
        ray.shutdown()
    # Two replicas, each an engine resolving and a worker actor loading: one GET of the weights on the node.
    assert len(s3.gets("tiny-llama/model.safetensors")) == 1
    assert len(s3.gets("serve-adapters/sql/adapter_model.safetensors")) == 1
    assert (copy_root(uri) / "tiny-llama" / "model.safetensors").read_bytes() == \
           (llama_path / "model.safetensors").read_bytes()
    assert (copy_root(adapter) / "sql" / "adapter_model.safetensors").is_file()
