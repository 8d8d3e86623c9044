"""Weights from object storage, against a real S3 server (moto's, started here; the client is s3fs, unmocked): a tiny
checkpoint and a LoRA adapter served from s3:// (offline, and over HTTP with the adapter found on demand under a
dynamic_lora_loading_path) give transformers' and PEFT's tokens from the local folder, their copies byte-identical; a
Ray worker on a node whose cache lacks the copies fetches its own (model and draft); two processes fetching at once
make one download; a download killed half-way is continued from its part, and fetched again whole when the continued
bytes do not hash to the ETag; an object changed in the bucket is fetched again; bad URIs, missing objects and
missing credentials are refused naming the field."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
from transformers import AutoTokenizer

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.default_model import resolve_model
from raylm.common.lora_request import LoRARequest
from raylm.common.object_storage import local_copy
from raylm.configs.cache import content_key
from raylm.configs.engine_config import ModelConfig
from raylm.configs.envs import cache_dir
from tests.gguf_files import write_gguf
from tests.http_server import served_engine
from tests.lora_utils import make_adapter, peft_greedy
from tests.reference import TOP_K, check_logprobs_close, hf_greedy
from tests.s3_server import BUCKET, S3, cache_fixture, copy_root, s3_fixture  # noqa: F401  (the fixtures)

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(max_model_len=128, block_size=4, disable_log_stats=True)
PROMPTS = [[5, 17, 300, 42], [9, 8, 7]]
MAX_TOKENS = 8


def node_cache(tmp_path: Path) -> Path:
    """A cache for a second node: the built kernels and plans linked in, no object-storage copies."""
    other = tmp_path / "other-node-cache"
    other.mkdir()
    for entry in cache_dir().iterdir():
        if entry.name != "object-storage":
            (other / entry.name).symlink_to(entry)
    return other


Result = list[tuple[list[int], list[dict[int, float]]]]


def generate(llm: LLM, lora_request: LoRARequest | None = None) -> Result:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def adapter(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(llama_path, tmp_path_factory.mktemp("adapters") / "sql", seed=1, r=8)


def test_llm_and_an_adapter_from_s3_match_transformers(s3: S3, llama_path: Path, adapter: Path, cache: Path) -> None:
    """The copy is the local folder byte for byte, and the engine serving it (base and adapter) answers as
    transformers and PEFT do from the local folder."""
    uri, adapter_uri = s3.upload(llama_path, "tiny-llama"), s3.upload(adapter, "adapters/sql")
    llm = LLM(model=uri, enable_lora=True, max_lora_rank=8, **ENGINE)
    info = llm.llm_engine.config.model_info
    copy = Path(info.path)
    assert info.source == uri and copy.is_relative_to(cache) and files_of(copy) == files_of(llama_path)
    # The KV identity names the URI, not this node's cache path: engines on nodes with other caches share KV.
    assert llm.llm_engine.config.resolved.kv_identity.model == uri
    check_logprobs_close(hf_greedy(llama_path, PROMPTS, MAX_TOKENS), generate(llm), "base from s3")
    check_logprobs_close(peft_greedy(llama_path, adapter, PROMPTS, MAX_TOKENS),
                         generate(llm, LoRARequest("sql", 1, adapter_uri)), "adapter from s3")
    assert files_of(copy_root(adapter_uri) / "sql") == files_of(adapter)
    # Beside the copy: each object's size and ETag as the bucket lists them.
    manifest = json.loads((copy_root(uri) / "manifest.json").read_text())
    listed = fsspec.filesystem("s3", skip_instance_cache=True).find(f"{BUCKET}/tiny-llama", detail=True)
    assert {rel: (entry["size"], entry["etag"]) for rel, entry in manifest["files"].items()} == \
           {key.split("tiny-llama/")[1]: (e["size"], e["ETag"].strip('"')) for key, e in listed.items()}


def test_openai_server_serves_the_model_and_adapters_on_demand_from_s3(s3: S3, llama_path: Path,
                                                                        adapter: Path) -> None:
    """`raylm serve s3://...` with a dynamic_lora_loading_path prefix: /v1/models lists the adapter found there, and
    completions of the base model and of the adapter (loaded on first use) are transformers' and PEFT's tokens."""
    uri, _ = s3.upload(llama_path, "tiny-llama"), s3.upload(adapter, "adapters/sql")
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    references = {uri: hf_greedy(llama_path, PROMPTS[:1], MAX_TOKENS),
                  "sql": peft_greedy(llama_path, adapter, PROMPTS[:1], MAX_TOKENS)}
    with served_engine(uri, enable_lora=True, max_lora_rank=8,  # type: ignore[arg-type]  (a URI, not a Path)
                       dynamic_lora_loading_path=f"s3://{BUCKET}/adapters") as (server, _):
        status, body = server.request("GET", "/v1/models")
        assert status == 200 and {card["id"]: card["parent"] for card in body["data"]} == {uri: None, "sql": uri}
        for model, (((tokens, _),)) in references.items():
            status, body = server.request("POST", "/v1/completions", {
                "model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 0})
            assert status == 200, body
            assert body["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in tokens], model


def test_a_ray_worker_on_another_node_copies_it_there(s3: S3, llama_path: Path, cache: Path, tmp_path: Path) -> None:
    """The worker actor's cache is another folder than the engine's, as on another node: it fetches its own copy of
    the model and of the draft model (the same checkpoint under another prefix: a draft always accepted)."""
    import ray

    uri, draft_uri = s3.upload(llama_path, "tiny-llama"), s3.upload(llama_path, "tiny-draft")
    worker_cache = node_cache(tmp_path)
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"RAYLM_CACHE_DIR": str(worker_cache), "PYTHONPATH": str(REPO_ROOT)}})
    try:
        before = {name: len(s3.gets(f"{name}/model.safetensors")) for name in ("tiny-llama", "tiny-draft")}
        llm = LLM(model=uri, distributed_executor_backend="ray", speculative_config={
            "method": "draft_model", "model": draft_uri, "num_speculative_tokens": 2}, **ENGINE)
        check_logprobs_close(hf_greedy(llama_path, PROMPTS, MAX_TOKENS), generate(llm), "base from s3 on Ray")
        llm.shutdown()  # its workers, before their Ray goes
    finally:
        ray.shutdown()
    # One download per node: the engine's, then the worker's.
    assert {name: len(s3.gets(f"{name}/model.safetensors")) - n for name, n in before.items()} == \
           {"tiny-llama": 2, "tiny-draft": 2}
    for name, source in (("tiny-llama", uri), ("tiny-draft", draft_uri)):
        engine_copy, worker_copy = (root / "object-storage" / content_key(source) / name
                                    for root in (cache, worker_cache))
        assert files_of(engine_copy) == files_of(worker_copy) == files_of(llama_path)


def test_two_processes_fetching_at_once_download_once(s3: S3, llama_path: Path, tmp_path: Path) -> None:
    uri = s3.upload(llama_path, "tiny-llama")
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        from raylm.common.object_storage import local_copy
        pathlib.Path(sys.argv[1]).touch()
        while not pathlib.Path({str(go)!r}).exists():
            time.sleep(0.002)
        print(local_copy({uri!r}, "model"))
    """)
    before = {name: len(s3.gets(f"tiny-llama/{name}")) for name in files_of(llama_path)}
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(flag)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              text=True) for flag in ready]
    deadline = time.monotonic() + 60
    while not all(flag.exists() for flag in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # both start copying together
    paths = [proc.communicate(timeout=60)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs) and paths[0] == paths[1]
    assert files_of(Path(paths[0])) == files_of(llama_path)
    assert {name: len(s3.gets(f"tiny-llama/{name}")) - n for name, n in before.items()} == dict.fromkeys(before, 1)


def kill_half_way(uri: str) -> Path:
    """Copy `uri` in a process killed in its third 4 KiB request of the weights; the copy's root."""
    script = textwrap.dedent(f"""
        import os, signal
        from raylm.common import object_storage
        object_storage.CHUNK_BYTES = 4096
        real_filesystem = object_storage._filesystem

        def filesystem(uri, field):
            fs = real_filesystem(uri, field)
            cat_file, starts = fs.cat_file, []

            def killed_on_the_third_weights_chunk(path, start=None, end=None, **kwargs):
                if path.endswith("model.safetensors"):
                    starts.append(start)
                    if len(starts) == 3:
                        os.kill(os.getpid(), signal.SIGKILL)
                return cat_file(path, start=start, end=end, **kwargs)

            fs.cat_file = killed_on_the_third_weights_chunk
            return fs

        object_storage._filesystem = filesystem
        object_storage.local_copy({uri!r}, "model")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == -9, result.stderr
    return copy_root(uri)


def weights_gets(s3: S3, since: int) -> list[str | None]:
    """The Range headers of the GETs of the weights since request `since`."""
    return [rng for method, path, rng in s3.server.requests[since:]
            if method == "GET" and path == f"/{BUCKET}/tiny-llama/model.safetensors"]


def test_a_download_killed_half_way_is_continued(s3: S3, llama_path: Path, cache: Path) -> None:
    """A process killed in its third 4 KiB request of the weights leaves the files before them done and 8 KiB of
    the weights in a part; the next copy fetches only the rest of the weights, from byte 8192."""
    uri = s3.upload(llama_path, "tiny-llama")
    root = kill_half_way(uri)
    assert not (root / "tiny-llama" / "model.safetensors").exists()  # a half-written file is never in the copy
    assert (root / "partial" / "model.safetensors").stat().st_size == 8192
    assert (root / "tiny-llama" / "config.json").read_bytes() == (llama_path / "config.json").read_bytes()

    before = len(s3.server.requests)
    copy = local_copy(uri, "model")
    weights_size = (llama_path / "model.safetensors").stat().st_size
    assert weights_gets(s3, before) == [f"bytes=8192-{weights_size - 1}"]
    assert not any(method == "GET" and path == f"/{BUCKET}/tiny-llama/config.json"
                   for method, path, _ in s3.server.requests[before:])
    assert files_of(copy) == files_of(llama_path) and not any((root / "partial").rglob("*.safetensors"))


def test_a_continued_download_that_does_not_hash_to_its_etag_is_fetched_again(s3: S3, llama_path: Path,
                                                                              cache: Path) -> None:
    """A part whose bytes went bad on disk: the continued object's MD5 is not its ETag, so it is fetched again
    whole and the copy is the bucket's."""
    uri = s3.upload(llama_path, "tiny-llama")
    part = kill_half_way(uri) / "partial" / "model.safetensors"
    damaged = bytearray(part.read_bytes())
    damaged[100] ^= 0xFF
    part.write_bytes(bytes(damaged))

    before = len(s3.server.requests)
    copy = local_copy(uri, "model")
    weights_size = (llama_path / "model.safetensors").stat().st_size
    assert weights_gets(s3, before) == [f"bytes=8192-{weights_size - 1}", f"bytes=0-{weights_size - 1}"]
    assert files_of(copy) == files_of(llama_path)


def test_objects_changed_or_deleted_in_the_bucket_change_the_copy(s3: S3, llama_path: Path, tmp_path: Path) -> None:
    folder = tmp_path / "changing"
    folder.mkdir()
    (folder / "a.txt").write_text("first")
    (folder / "b.txt").write_text("kept")
    (folder / "c.txt").write_text("deleted from the bucket")
    uri = s3.upload(folder, "changing")
    copy = local_copy(uri, "model")
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.pipe_file(f"{BUCKET}/changing/a.txt", b"second, longer")
    fs.rm_file(f"{BUCKET}/changing/c.txt")
    before = len(s3.gets("changing/b.txt"))
    assert local_copy(uri, "model") == copy and files_of(copy) == {"a.txt": b"second, longer", "b.txt": b"kept"}
    assert len(s3.gets("changing/b.txt")) == before  # the unchanged object stays as copied
    assert set(json.loads((copy_root(uri) / "manifest.json").read_text())["files"]) == {"a.txt", "b.txt"}


def test_a_gguf_object_is_copied_as_a_file_and_served(s3: S3, llama_path: Path, tmp_path: Path) -> None:
    """One .gguf object (float32 throughout: the checkpoint's own weights) is a file in the copy, and the engine
    serving its URI answers as transformers does from the checkpoint."""
    import gguf

    f32 = gguf.GGMLQuantizationType.F32
    path = write_gguf(llama_path, tmp_path / "tiny.gguf", f32, embedding_type=f32)
    uri = s3.upload(path, "gguf/tiny.gguf")
    copy = Path(resolve_model(ModelConfig(model=uri)).model or "")
    assert copy.name == "tiny.gguf" and copy.read_bytes() == path.read_bytes()
    llm = LLM(model=uri, **ENGINE)
    try:
        assert llm.llm_engine.config.model_info.source == uri
        check_logprobs_close(hf_greedy(llama_path, PROMPTS, MAX_TOKENS), generate(llm), "gguf from s3")
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("settings", "error"), [
    (dict(model="s3://{bucket}/missing"), "model: s3://{bucket}/missing holds no objects"),
    (dict(model="s3://"), "model: 's3://' names no bucket"),
    (dict(model="s3://{bucket}"), "model: 's3://{bucket}' names no object or prefix"),
    (dict(model="{local}", enable_lora=True, lora_modules=["sql=s3://{bucket}/adapters/none"]),
     "lora_modules (sql): s3://{bucket}/adapters/none holds no objects"),
    (dict(model="{local}", enable_lora=True, dynamic_lora_loading_path="s3://no-such-bucket/adapters"),
     "dynamic_lora_loading_path: s3://no-such-bucket/adapters holds no objects"),
])
def test_bad_sources_are_refused_naming_the_field(s3: S3, llama_path: Path, settings: dict[str, Any],
                                                  error: str) -> None:
    settings = {name: value.format(local=llama_path, bucket=BUCKET) if isinstance(value, str) else
                [v.format(bucket=BUCKET) for v in value] if isinstance(value, list) else value
                for name, value in settings.items()}
    with pytest.raises(ValueError, match=re.escape(error.format(bucket=BUCKET))) as refused:
        LLM(**settings, **ENGINE)
    assert "s3://bucket/prefix" in str(refused.value)  # and what would work
    if settings["model"].startswith("s3://") and settings["model"] != "s3://":
        assert not copy_root(settings["model"]).exists()  # nothing left in the cache


def test_missing_credentials_are_refused_naming_the_variables(s3: S3, llama_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    uri = s3.upload(llama_path, "tiny-llama")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ValueError, match=re.escape(f"model: {uri}: no credentials were found") + ".*" +
                       "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        LLM(model=uri, **ENGINE)
    assert os.environ["AWS_ENDPOINT_URL"]  # the server was there: only the credentials were missing
