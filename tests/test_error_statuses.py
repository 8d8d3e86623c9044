"""An error is never a 200: a request the engine fails (finish_reason "error") is a 500 in OpenAI's error body, or an
error event then [DONE] when streamed, through the openai client; offline it comes back with finish_reason "error" and
the reason, logged, beside the other prompts' whole outputs. The failure is a real one: a structural tag whose
schema passes the frontend's check but that xgrammar cannot compile against the tokenizer."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.entrypoints.llm import LLM
from raylm.common.sampling_params import SamplingParams
from raylm.common.structured_outputs import StructuredOutputsParams
from raylm.configs import make_engine_config
from tests.http_server import Server, engine_settings, metric, served_engine

# Checked by the frontend (its parts parse), refused by xgrammar's compiler once it has the tokenizer.
FAILING_TAG = json.dumps({"structures": [{"begin": "<a>", "schema": {"type": "notatype"}, "end": "</a>"}],
                          "triggers": ["<a"]})
FAILING = {"structured_outputs": {"structural_tag": FAILING_TAG}}
MESSAGES = [{"role": "user", "content": "hi"}]


def failing_params(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(structural_tag=FAILING_TAG))


def assert_engine_failures_are_errors(base_url: str, model: str) -> None:
    """Completions and chat, whole and streamed: a 500 with the engine's reason, or an error event and [DONE]."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    calls = {"completions": lambda **kw: client.completions.create(model=model, prompt="hi", max_tokens=4, **kw),
             "chat": lambda **kw: client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **kw)}
    for name, call in calls.items():
        with pytest.raises(openai.InternalServerError) as failed:
            call(extra_body=FAILING)
        assert failed.value.status_code == 500, name
        body = failed.value.body
        assert isinstance(body, dict) and body["code"] == 500 and body["type"] == "internal_server_error", body
        assert "failed to compile" in body["message"], body
        with pytest.raises(openai.APIError, match="failed to compile"):
            for _ in call(extra_body=FAILING, stream=True):
                pass
        # The engine goes on serving.
        assert call(extra_body={"ignore_eos": True}).choices[0].finish_reason == "length", name


@pytest.fixture(scope="module")
def server(llama_path: Path) -> Iterator[Server]:
    with served_engine(llama_path) as (server, _):
        yield server


def test_engine_failures_are_500s_and_error_events_over_http(server: Server, llama_path: Path) -> None:
    assert_engine_failures_are_errors(server.base_url, llama_path.name)
    assert metric(server, "vllm:request_success_total", llama_path.name, finished_reason="error") >= 4


def test_a_streamed_failure_ends_with_an_error_event_then_done(server: Server, llama_path: Path) -> None:
    """The raw stream, as vLLM frames it: the role chunk, then `data: {"error": {...}}`, then `data: [DONE]`."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": llama_path.name, "messages": MESSAGES, "max_tokens": 4, "stream": True, **FAILING}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    events = [line for line in response.read().decode().split("\n\n") if line]
    conn.close()
    assert response.status == 200  # the status went out with the headers, before the engine failed it
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "failed to compile" in error["message"], error
    assert all("finish_reason\": \"abort" not in event for event in events)


def test_offline_failure_is_finish_reason_error_beside_whole_outputs(llama_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    llm = LLM(str(llama_path), **_small_engine())
    try:
        plain = SamplingParams(max_tokens=4, temperature=0.0)
        with caplog.at_level(logging.WARNING, logger="raylm.cluster.entrypoints.llm"):
            outputs = llm.generate(["hello", "hello", "world"], [plain, failing_params(), plain], use_tqdm=False)
        alone = llm.generate(["hello", "world"], plain, use_tqdm=False)
    finally:
        llm.shutdown()
    failed = outputs[1].outputs[0]
    assert failed.finish_reason == "error" and failed.stop_reason is None and failed.text == ""
    assert failed.error is not None and "failed to compile" in failed.error
    assert any("failed to compile" in record.getMessage() for record in caplog.records)
    for output, reference in zip([outputs[0], outputs[2]], alone):
        assert output.outputs[0].error is None
        assert (output.outputs[0].token_ids, output.outputs[0].finish_reason) == (
            reference.outputs[0].token_ids, "length")


def test_offline_logit_bias_outside_the_vocabulary_is_refused(llama_path: Path) -> None:
    llm = LLM(str(llama_path), **_small_engine())
    try:
        with pytest.raises(ValueError, match=r"logit_bias: token ids \[-3\] are outside the vocabulary"):
            llm.generate("hello", SamplingParams(max_tokens=2, logit_bias={-3: 1.0}), use_tqdm=False)
        assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_async_llm_gives_the_error_in_the_output(llama_path: Path) -> None:
    engine = AsyncLLM(make_engine_config(**_small_engine(), model=str(llama_path)))

    async def run() -> list[Any]:
        await engine.wait_until_ready()
        return [output async for output in engine.generate("req", "hello", failing_params())]

    try:
        outputs = asyncio.run(run())
    finally:
        engine.shutdown()
    last = outputs[-1]
    assert last.finished and last.outputs[0].finish_reason == "error"
    assert "failed to compile" in (last.outputs[0].error or "")


def _small_engine() -> dict[str, Any]:
    settings = engine_settings(Path("unused"))
    del settings["model"]
    return settings
