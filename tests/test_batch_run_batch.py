"""`raylm run-batch`: an OpenAI Batch file (chat and completions lines, and requests the server refuses) answered as
the OpenAI server answers the same requests over HTTP; in this process, and on a Ray Data pool with output to an
fsspec URI."""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import ray

from raylm.cluster.entrypoints.cli import main
from tests.http_server import engine_settings, served_engine

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
REQUESTS = [
    ("chat-0", CHAT, {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0}),
    ("cmpl-0", COMPLETIONS, {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0}),
    ("chat-1", CHAT, {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
                      "max_completion_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("cmpl-1", COMPLETIONS, {"prompt": ["one two", "three"], "max_tokens": 3, "temperature": 0, "n": 2,
                             "seed": 7}),
    ("cmpl-too-long", COMPLETIONS, {"prompt": "la " * 300, "max_tokens": 3}),  # over max_model_len: a 400
    ("chat-bad-field", CHAT, {"messages": "not a list", "max_tokens": 3}),  # a body FastAPI would refuse: a 400
    ("embed", "/v1/embeddings", {"input": ["text", "more text"], "encoding_format": "float"}),
    ("moderate", "/v1/moderations", {"input": "text"}),  # not answered here: a 404
]
_VOLATILE = ("id", "created")  # differ from one answer to the next


def settings_flags(model: Path) -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in engine_settings(model).items()]


def write_requests(path: Path) -> None:
    path.write_text("".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"
                            for custom_id, url, body in REQUESTS))


def stable(body: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if body is None else {key: value for key, value in body.items() if key not in _VOLATILE}


def same_answer(left: Any, right: Any) -> bool:
    """Equal, floats to 1e-5: a logprob's last bits depend on which requests shared its step (float32 sums in
    another order), and the step a request lands in depends on timing."""
    if isinstance(left, float) and isinstance(right, float):
        return math.isclose(left, right, rel_tol=0, abs_tol=1e-5)
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(same_answer(left[key], right[key]) for key in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(same_answer, left, right))
    return bool(left == right)


@pytest.fixture(scope="module")
def answered_here(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("run_batch")
    write_requests(folder / "requests.jsonl")
    assert main(["run-batch", "-i", f"file://{folder / 'requests.jsonl'}", "-o", str(folder / "results.jsonl"),
                 *settings_flags(llama_path)]) == 0
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_run_batch_answers_as_the_server_does(llama_path: Path, answered_here: list[dict[str, Any]]) -> None:
    assert [output["custom_id"] for output in answered_here] == [custom_id for custom_id, _, _ in REQUESTS]
    assert len({output["id"] for output in answered_here}) == len(REQUESTS)
    with served_engine(llama_path) as (server, _):
        for output, (custom_id, url, body) in zip(answered_here, REQUESTS):
            status, served = server.request("POST", url, body)
            assert output["response"]["status_code"] == status, custom_id
            if status == 200:
                assert output["error"] is None, custom_id
                assert same_answer(stable(output["response"]["body"]), stable(served)), (output, served)
            else:
                assert output["response"]["body"] is None, custom_id
                # The same error, word for word, where the same code makes it (a route missing is the HTTP app's).
                expected = served if status == 400 else {"error": output["error"]["error"] | {"code": 404}}
                assert output["error"] == expected, custom_id
    statuses = {output["custom_id"]: output["response"]["status_code"] for output in answered_here}
    assert statuses == {"chat-0": 200, "cmpl-0": 200, "chat-1": 200, "cmpl-1": 200, "cmpl-too-long": 400,
                        "chat-bad-field": 400, "embed": 200, "moderate": 404}
    assert "maximum context length" in answered_here[4]["error"]["error"]["message"]
    assert "messages" in answered_here[5]["error"]["error"]["message"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(address="local", num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    yield
    ray.shutdown()


def test_run_batch_on_a_pool_writes_to_a_uri(local_ray: None, llama_path: Path, tmp_path: Path,
                                             answered_here: list[dict[str, Any]]) -> None:
    write_requests(tmp_path / "requests.jsonl")
    output_uri = "memory://run-batch/results.jsonl"  # an fsspec filesystem that pyarrow.fs does not know
    assert main(["run-batch", "-i", str(tmp_path / "requests.jsonl"), "-o", output_uri, "--concurrency", "1",
                 "--batch-size", "3", "--max-concurrent-batches", "3", *settings_flags(llama_path)]) == 0
    with fsspec.open(output_uri, "r") as file:
        on_pool = [json.loads(line) for line in file.read().splitlines()]
    assert [output["custom_id"] for output in on_pool] == [custom_id for custom_id, _, _ in REQUESTS]
    for pooled, here in zip(on_pool, answered_here):
        assert pooled["response"]["status_code"] == here["response"]["status_code"], here["custom_id"]
        assert same_answer(stable(pooled["response"]["body"]), stable(here["response"]["body"])), (pooled, here)
        assert pooled["error"] == here["error"], here["custom_id"]


def test_a_line_that_is_no_batch_request_fails_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "requests.jsonl").write_text('{"custom_id": "a", "url": "/v1/completions", "body": {}}\n'
                                             '{"url": "/v1/completions", "body": {}}\n')
    assert main(["run-batch", "-i", str(tmp_path / "requests.jsonl"), "-o", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "input line 2" in err and "custom_id: Field required" in err
    assert not (tmp_path / "out.jsonl").exists()
