"""The token that stops a request (EOS or one of stop_token_ids) stays in the token ids but, as in vLLM, its text is
not in the output unless include_stop_str_in_output: with skip_special_tokens=False the EOS text ('<|end_of_text|>',
or Mistral's '</s>' after tool calls) must not show up as content. Offline LLM and the OpenAI server, streamed too."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from raylm import LLM, SamplingParams
from raylm.cluster.core.engine_core_output import EngineCoreOutput
from raylm.cluster.engine.output_processor import OutputProcessor
from raylm.cluster.engine.outputs import RequestOutput
from tests.http_server import served_engine

PROMPT = "hello world"
# EOS is masked for the first MIN_TOKENS tokens; a large bias makes greedy sampling pick it right after.
MIN_TOKENS = 2


@pytest.fixture(scope="module")
def llm(llama_path: Path) -> LLM:
    return LLM(model=str(llama_path), max_model_len=128, block_size=16, num_gpu_blocks_override=32,
               distributed_executor_backend="uni")


def _generate(llm: LLM, **params: Any) -> Any:
    return llm.generate([PROMPT], SamplingParams(temperature=0.0, skip_special_tokens=False, **params))[0].outputs[0]


def test_eos_stop_keeps_the_token_and_leaves_its_text_out(llm: LLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    reference = _generate(llm, max_tokens=MIN_TOKENS, min_tokens=MIN_TOKENS)
    forced = dict(max_tokens=MIN_TOKENS + 4, min_tokens=MIN_TOKENS, logit_bias={eos: 100.0})
    out = _generate(llm, **forced)
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.token_ids == [*reference.token_ids, eos]
    assert out.text == reference.text
    included = _generate(llm, **forced, include_stop_str_in_output=True)
    assert included.token_ids == out.token_ids
    assert included.text == reference.text + llm.get_tokenizer().eos_token


def test_stop_token_ids_stop_leaves_the_token_text_out(llm: LLM) -> None:
    greedy = _generate(llm, max_tokens=3, ignore_eos=True)
    stop_token = greedy.token_ids[2]
    assert stop_token not in greedy.token_ids[:2]  # else the request would stop earlier
    out = _generate(llm, max_tokens=6, stop_token_ids=[stop_token])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    assert out.token_ids == greedy.token_ids
    assert out.text == _generate(llm, max_tokens=2, ignore_eos=True).text
    included = _generate(llm, max_tokens=6, stop_token_ids=[stop_token], include_stop_str_in_output=True)
    assert included.text == greedy.text


def test_a_stop_on_a_content_token_keeps_its_text(llama_path: Path) -> None:
    """A grammar's end (finish reason stop) on a content token is no stop token: its text is output; an EOS in the
    same position is not. Streamed as deltas, the EOS text never appears either."""
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    processor = OutputProcessor(tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    ids = tokenizer.encode(" ab cd", add_special_tokens=False)
    params = SamplingParams(skip_special_tokens=False)
    texts = {}
    for request_id, last in (("content", ids[-1]), ("eos", tokenizer.eos_token_id)):
        processor.add_request(request_id, PROMPT, [5], params, output_kind="delta")
        steps = [EngineCoreOutput(request_id, ids[:-1]), EngineCoreOutput(request_id, [last], "stop")]
        outputs = [out for step in steps for out in processor.process_outputs([step]).request_outputs
                   if isinstance(out, RequestOutput)]
        texts[request_id] = "".join(out.outputs[0].text for out in outputs)
        assert outputs[-1].outputs[0].token_ids == [last]
    assert texts == {"content": tokenizer.decode(ids), "eos": tokenizer.decode(ids[:-1])}


@pytest.fixture(scope="module")
def client(llama_path: Path) -> Iterator[openai.OpenAI]:
    with served_engine(llama_path) as (server, _):
        yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_openai_server_leaves_the_eos_text_out_streamed_or_not(client: openai.OpenAI, llama_path: Path,
                                                               route: str) -> None:
    eos = AutoTokenizer.from_pretrained(llama_path).eos_token_id

    def create(stream: bool, **fields: Any) -> Any:
        common = dict(model=llama_path.name, temperature=0.0, stream=stream,
                      extra_body={"skip_special_tokens": False, "min_tokens": MIN_TOKENS}, **fields)
        if route == "chat":
            return client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **common)
        return client.completions.create(prompt=PROMPT, **common)

    def text_and_finish(stream: bool, **fields: Any) -> tuple[str, str | None]:
        if not stream:
            choice = create(False, **fields).choices[0]
            return (choice.message.content if route == "chat" else choice.text), choice.finish_reason
        text, finish_reason = "", None
        for chunk in create(True, **fields):
            for choice in chunk.choices:
                text += (choice.delta.content or "") if route == "chat" else choice.text
                finish_reason = choice.finish_reason or finish_reason
        return text, finish_reason

    reference, _ = text_and_finish(False, max_tokens=MIN_TOKENS)
    for stream in (False, True):
        text, finish_reason = text_and_finish(stream, max_tokens=MIN_TOKENS + 4, logit_bias={str(eos): 100})
        assert (text, finish_reason) == (reference, "stop"), f"stream={stream}"
