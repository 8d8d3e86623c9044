"""The OpenAI HTTP app on a real socket, driven by the official `openai` client (and raw HTTP where the
client would hide the status or shape): models, completions, chat, streaming, sampling fields, errors."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.http_server import MAX_MODEL_LEN, Server, served_engine

TOO_LONG = "word " * MAX_MODEL_LEN  # at least one token per word


@pytest.fixture(scope="module")
def server(llama_path: Path) -> Iterator[Server]:
    with served_engine(llama_path) as (server, _):
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(llama_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(llama_path)


def _chat_prompt_len(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---- models --------------------------------------------------------------------------------------


def test_models(client: openai.OpenAI, llama_path: Path) -> None:
    assert [model.id for model in client.models.list()] == [llama_path.name]
    card = client.models.retrieve(llama_path.name)
    assert card.id == llama_path.name and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# ---- completions ---------------------------------------------------------------------------------


def test_completion_stream_matches_whole_response(client: openai.OpenAI, tokenizer: Any, llama_path: Path) -> None:
    prompt = "The quick brown fox jumps over"
    common = dict(model=llama_path.name, prompt=prompt, max_tokens=12, temperature=0.0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**common, logprobs=2)
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == len(choice.logprobs.tokens) == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)

    chunks = list(client.completions.create(**common, logprobs=0, stream=True,
                                            stream_options={"include_usage": True}))
    content, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in content) == choice.text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert sum(len(c.choices[0].logprobs.tokens) for c in content) == 12


def test_completion_prompt_forms(client: openai.OpenAI, tokenizer: Any, llama_path: Path) -> None:
    ids = tokenizer.encode("Once upon a time")
    by_text = client.completions.create(model=llama_path.name, prompt="Once upon a time", max_tokens=6,
                                        temperature=0.0)
    by_ids = client.completions.create(model=llama_path.name, prompt=ids, max_tokens=6, temperature=0.0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    texts = client.completions.create(model=llama_path.name, prompt=["Once upon a time", "Another prompt"],
                                      max_tokens=4, n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in texts.choices) == [0, 1, 2, 3]
    assert texts.usage.completion_tokens == 16
    assert texts.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Another prompt"))
    id_lists = client.completions.create(model=llama_path.name, prompt=[ids, ids[:2]], max_tokens=3)
    assert sorted(c.index for c in id_lists.choices) == [0, 1]
    assert id_lists.usage.prompt_tokens == len(ids) + 2


def test_stop_strings(client: openai.OpenAI, llama_path: Path) -> None:
    common = dict(model=llama_path.name, prompt="In the garden the", max_tokens=24, temperature=0.0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**common).choices[0].text
    # A stop string that first appears a few characters in, so that the output is cut there.
    start = next(k for k in range(4, len(full) - 3) if full.index(full[k:k + 3]) == k)
    stop, expected = full[start:start + 3], full[:start]
    stopped = client.completions.create(**common, stop=[stop, "never appears"]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (expected, "stop")
    streamed = list(client.completions.create(**common, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility_and_n(client: openai.OpenAI, llama_path: Path) -> None:
    def sample(seed: int, n: int = 1) -> list[str]:
        response = client.completions.create(model=llama_path.name, prompt="A story:", max_tokens=10,
                                             temperature=1.0, seed=seed, n=n, extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == 10 * n
        return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]

    assert sample(123) == sample(123)
    assert sample(123) != sample(124)
    pair = sample(7, n=2)
    assert len(pair) == 2 and pair[0] != pair[1] and pair == sample(7, n=2)


# ---- chat ----------------------------------------------------------------------------------------


def test_chat(client: openai.OpenAI, tokenizer: Any, llama_path: Path) -> None:
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "Tell me about the river."}]
    common = dict(model=llama_path.name, messages=messages, temperature=0.0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**common, max_completion_tokens=10, logprobs=True, top_logprobs=3)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == _chat_prompt_len(tokenizer, messages)
    assert whole.usage.completion_tokens == len(choice.logprobs.content) == 10
    assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)

    chunks = list(client.chat.completions.create(**common, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    first, content, usage_chunk = chunks[0], chunks[1:-1], chunks[-1]
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    assert "".join(c.choices[0].delta.content for c in content) == choice.message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert len({c.id for c in chunks}) == 1


def test_concurrent_streams(server: Server, llama_path: Path) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.chat.completions.create(
            model=llama_path.name, messages=[{"role": "user", "content": f"Question number {i}"}], max_tokens=16,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage, finish = 0, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            elif chunk.choices[0].finish_reason is not None:
                finish = chunk.choices[0].finish_reason
        return usage, finish

    async def run_all() -> list[tuple[int, str | None]]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*[one(client, i) for i in range(16)])

    assert asyncio.run(run_all()) == [(16, "length")] * 16


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", {"prompt": TOO_LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": TOO_LONG, "stream": True}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ["hi", "hello"], "max_tokens": MAX_MODEL_LEN, "stream": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_MODEL_LEN}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "max_completion_tokens": MAX_MODEL_LEN}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ("/v1/nowhere", {}, 404, None),
])
def test_bad_input(server: Server, llama_path: Path, path: str, body: dict, status: int, param: str | None) -> None:
    got_status, got = server.request("POST", path, body)
    assert got_status == status
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["code"] == status and got["error"]["param"] == param and got["error"]["message"]
    ok_status, ok = server.request("POST", "/v1/completions", {"prompt": "still serving", "max_tokens": 2})
    assert ok_status == 200 and ok["usage"]["completion_tokens"] >= 1


def test_max_tokens_beyond_max_model_len_is_refused_like_vllm(client: openai.OpenAI, tokenizer: Any,
                                                               llama_path: Path) -> None:
    prompt = list(range(10, 30))
    room = MAX_MODEL_LEN - len(prompt)
    fits = client.completions.create(model=llama_path.name, prompt=prompt, max_tokens=room, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == room
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=llama_path.name, prompt=prompt, max_tokens=room + 1)
    assert refused.value.body["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: {room + 1}. This model's maximum context length is "
        f"{MAX_MODEL_LEN} tokens and your request has {len(prompt)} input tokens ({room + 1} > {MAX_MODEL_LEN} - "
        f"{len(prompt)}).")
    messages = [{"role": "user", "content": "Tell me about the river."}]
    chat_room = MAX_MODEL_LEN - _chat_prompt_len(tokenizer, messages)
    with pytest.raises(openai.BadRequestError, match=f"is too large: {chat_room + 1}. "):
        client.chat.completions.create(model=llama_path.name, messages=messages, max_tokens=chat_room + 1, stream=True)
    whole = client.chat.completions.create(model=llama_path.name, messages=messages, max_tokens=chat_room,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == chat_room


def test_logprobs_entries_as_vllm_returns_them(client: openai.OpenAI, llama_path: Path) -> None:
    """Sampled (not greedy), so that the sampled token is often outside the top 2: completions then list it first
    among 3 entries, chat keeps exactly 2, the sampled token first. (Completions key by text, so tokens that decode
    alike, such as partial UTF-8 bytes as U+FFFD, share an entry there, as in vLLM.)"""
    common = dict(model=llama_path.name, max_tokens=24, temperature=1.5, seed=3, extra_body={"ignore_eos": True})
    logprobs = client.completions.create(prompt="The quick brown fox", logprobs=2, **common).choices[0].logprobs
    assert [len(top) for top in logprobs.top_logprobs].count(3) > 0
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) <= 3 and next(iter(top)) == token and (top[token] == logprob or token == "\ufffd")
        assert len(top) < 3 or logprob < min(list(top.values())[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(24)]

    messages = [{"role": "user", "content": "The quick brown fox"}]
    content = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2,
                                             **common).choices[0].logprobs.content
    assert len(content) == 24
    for entry in content:
        assert [len(entry.top_logprobs), entry.top_logprobs[0].token, entry.top_logprobs[0].logprob] == \
            [2, entry.token, entry.logprob]
        assert entry.bytes == list(entry.token.encode()) == entry.top_logprobs[0].bytes


def test_malformed_json_and_unknown_fields(server: Server) -> None:
    status, body = server.request("POST", "/v1/completions", b'{"prompt": "hi",')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = server.request("POST", "/v1/completions",
                                  {"prompt": "hi", "max_tokens": 2, "best_of_something": 3, "user": "me"})
    assert status == 200 and body["object"] == "text_completion"
