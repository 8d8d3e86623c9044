"""Every request field is honoured or refused with a 400 that names it: chat messages by OpenAI's roles with the
fields each requires, an empty prompt, top_logprobs without logprobs, vLLM's fields raylm does not implement (only
their no-op value passes), and the ones it does: best_of equal to n, truncate_prompt_tokens, add_special_tokens,
continue_final_message. Fields nobody defines are accepted and logged."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.http_server import Server, served_engine

USER = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def server(llama_path: Path) -> Iterator[Server]:
    with served_engine(llama_path) as (server, _):
        yield server


@pytest.fixture(scope="module")
def tokenizer(llama_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(llama_path)


def completion(server: Server, **body: Any) -> tuple[int, Any]:
    return server.request("POST", "/v1/completions", {"prompt": "The river", "max_tokens": 3, **body})


def chat(server: Server, **body: Any) -> tuple[int, Any]:
    return server.request("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 3, **body})


def assert_refused(answer: tuple[int, Any], param: str, *words: str) -> None:
    status, body = answer
    assert status == 400, body
    assert body["error"]["param"] == param, body
    for word in (param, *words):
        assert word in body["error"]["message"], body


@pytest.mark.parametrize(("message", "words"), [
    ({"role": ""}, ("role", "'user'")),
    ({"role": "narrator", "content": "hi"}, ("role", "'assistant'")),
    ({"role": "user"}, ("content", "Field required")),
    ({"role": "tool", "content": "42"}, ("tool_call_id",)),
    ({"role": "assistant"}, ("content or tool_calls",)),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, ("text",)),
])
def test_a_message_without_a_role_or_its_fields_is_refused(server: Server, message: dict[str, Any],
                                                           words: tuple[str, ...]) -> None:
    assert_refused(chat(server, messages=[message]), "messages", *words)


def test_every_role_with_its_fields_is_served(server: Server) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text",
                                                                                         "text": "Hi"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "user", "content": ""}]
    status, body = chat(server, messages=messages)
    assert status == 200, body


def test_the_schemas_rules_are_the_servers(server: Server) -> None:
    assert_refused(completion(server, prompt=""), "prompt", "at least 1 character")
    assert_refused(completion(server, prompt=["a", ""]), "prompt")
    assert_refused(chat(server, top_logprobs=2), "top_logprobs", "logprobs")
    assert_refused(chat(server, top_logprobs=2, logprobs=False), "top_logprobs", "logprobs")
    assert chat(server, top_logprobs=2, logprobs=True)[0] == 200
    assert_refused(chat(server, continue_final_message=True), "continue_final_message", "add_generation_prompt")


@pytest.mark.parametrize(("field", "value", "no_op"), [
    ("use_beam_search", True, False), ("length_penalty", 0.5, 1.0), ("spaces_between_special_tokens", False, True),
    ("prompt_logprobs", 1, None), ("allowed_token_ids", [1, 2], None), ("bad_words", ["x"], None),
    ("logits_processors", ["mod.fn"], None), ("return_token_ids", True, None), ("request_id", "r1", None),
    ("echo", True, False), ("cache_salt", "s", None), ("vllm_xargs", {"a": 1}, None),
    ("return_tokens_as_token_ids", True, None),
])
def test_unimplemented_vllm_fields_are_refused_unless_a_no_op(server: Server, field: str, value: Any,
                                                             no_op: Any) -> None:
    for send in (completion, chat):
        assert_refused(send(server, **{field: value}), field, "not supported")
        assert send(server, **{field: no_op})[0] == 200
    assert completion(server, length_penalty=1)[0] == 200  # JSON's 1 is 1.0


def test_unimplemented_fields_of_one_endpoint(server: Server) -> None:
    assert_refused(completion(server, suffix="end"), "suffix", "not supported")
    assert_refused(completion(server, prompt_embeds="AAAA"), "prompt_embeds", "not supported")
    for field, value in (("chat_template", "{{ messages }}"), ("documents", [{"text": "d"}]),
                         ("mm_processor_kwargs", {}), ("include_reasoning", False), ("reasoning_effort", "low"),
                         ("functions", []), ("function_call", "auto")):
        assert_refused(chat(server, **{field: value}), field, "not supported")


def test_best_of_is_n_or_refused(server: Server) -> None:
    assert_refused(completion(server, best_of=3), "best_of", "must equal n (1)")
    status, body = completion(server, best_of=2, n=2)
    assert status == 200 and len(body["choices"]) == 2


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: Server, tokenizer: Any) -> None:
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog by the river bank")
    common = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    status, truncated = completion(server, prompt=ids, truncate_prompt_tokens=5, **common)
    assert status == 200 and truncated["usage"]["prompt_tokens"] == 5
    assert truncated["choices"][0]["text"] == completion(server, prompt=ids[-5:], **common)[1]["choices"][0]["text"]
    assert completion(server, prompt=ids, truncate_prompt_tokens=-1, **common)[1]["usage"]["prompt_tokens"] == len(ids)
    assert_refused(completion(server, truncate_prompt_tokens=0), "truncate_prompt_tokens")


def test_add_special_tokens(server: Server, tokenizer: Any) -> None:
    with_bos = completion(server, prompt="The river")[1]["usage"]["prompt_tokens"]
    without = completion(server, prompt="The river", add_special_tokens=False)[1]["usage"]["prompt_tokens"]
    assert (with_bos, without) == (len(tokenizer.encode("The river")),
                                   len(tokenizer.encode("The river", add_special_tokens=False)))
    assert with_bos == without + 1
    chat_len = len(tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True))
    assert chat_len  # the template renders
    plain = chat(server)[1]["usage"]["prompt_tokens"]
    assert chat(server, add_special_tokens=True)[1]["usage"]["prompt_tokens"] == plain + 1


def test_continue_final_message_continues_the_assistant(server: Server, tokenizer: Any) -> None:
    messages = [*USER, {"role": "assistant", "content": "The river is"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("The river is")
    status, body = chat(server, messages=messages, continue_final_message=True, add_generation_prompt=False)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))


def test_logit_bias_outside_the_vocabulary_is_refused_not_fatal(server: Server) -> None:
    """schemathesis found it: a negative token id reached the sampler's index_put_ and killed the engine (503s
    after)."""
    for stream in (False, True):
        assert_refused(completion(server, logit_bias={"-35152810": 1}, stream=stream), "logit_bias",
                       "outside the vocabulary [0, 512)")
        assert_refused(chat(server, logit_bias={"512": -1}, stream=stream), "logit_bias", "[512]")
    assert completion(server, logit_bias={"511": 1})[0] == 200


def test_unknown_fields_are_accepted_and_logged(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="raylm.cluster.entrypoints.openai.serving_engine"):
        assert completion(server, not_a_field=1)[0] == 200
    assert any("not_a_field" in record.getMessage() for record in caplog.records)
