"""GPT-OSS's reasoning parser (openai_gptoss) on outputs in OpenAI's harmony format, as gpt-oss writes them (its stop
tokens <|return|> and <|call|> left out, as the server leaves them): whole, and streamed token by token and several
tokens at a time, giving the same reasoning and content; with the `openai` tool parser after it; where the reasoning
ends, read from token ids."""
from __future__ import annotations

import json
from typing import Any

import pytest

from raylm.cluster.core.reasoning import HarmonyReasoningParser, get_reasoning_parser
from raylm.cluster.entrypoints.openai.chat_output import ChoiceOutputParser
from raylm.cluster.entrypoints.openai.tool_parsers import get_tool_parser
from raylm.cluster.models.tiny_tokenizer import build_tokenizer
from raylm.configs import make_engine_config
from tests.test_reasoning_parsers import token_deltas

MARKERS = ["<|channel|>", "<|message|>", "<|call|>", "<|return|>", "<|constrain|>"]  # <|start|>, <|end|>: built in
ANALYSIS = "<|channel|>analysis<|message|>The user asks for the weather in Paris. Use get_weather.<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + json.dumps({"city": "Paris"}))
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris, 21 degrees."
REASONING = "The user asks for the weather in Paris. Use get_weather."


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tokenizer = build_tokenizer(500, 0)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    return tokenizer


CASES = [
    ("answer", ANALYSIS + FINAL, REASONING, "It is sunny in Paris, 21 degrees."),
    ("final only", "<|channel|>final<|message|>Hello!", None, "Hello!"),
    ("cut short while reasoning", "<|channel|>analysis<|message|>Let me think", "Let me think", None),
    ("header cut short", ANALYSIS + "<|start|>assistant<|channel|>fi", REASONING, None),
    # A call, and a preamble before one, stay harmony text for the openai tool parser.
    ("call", ANALYSIS + CALL, REASONING, CALL),
    ("preamble and call", ANALYSIS + PREAMBLE + CALL, REASONING, PREAMBLE + CALL),
    ("plain", "No harmony here.", None, "No harmony here."),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_whole_and_streamed(tokenizer: Any, text: str, reasoning: str | None, content: str | None) -> None:
    parser = get_reasoning_parser("openai_gptoss", tokenizer)
    assert isinstance(parser, HarmonyReasoningParser)
    assert parser.extract_reasoning(text) == (reasoning, content)
    for tokens_per_delta in (1, 3):
        stream = parser.stream()
        pieces = [stream.feed(delta) for delta in token_deltas(tokenizer, text, tokens_per_delta)]
        assert "".join(r for r, _ in pieces) == (reasoning or "")
        assert "".join(c for _, c in pieces) == (content or "")


@pytest.mark.parametrize(("text", "content", "calls"), [
    (ANALYSIS + FINAL, "It is sunny in Paris, 21 degrees.", []),
    (ANALYSIS + CALL, None, [("get_weather", {"city": "Paris"})]),
    (ANALYSIS + PREAMBLE + CALL, "Checking the forecast.", [("get_weather", {"city": "Paris"})]),
], ids=["answer", "call", "preamble and call"])
def test_with_the_openai_tool_parser(tokenizer: Any, text: str, content: str | None,
                                     calls: list[tuple[str, dict]]) -> None:
    """The chat message a client gets: reasoning_content, then the calls and content the tool parser reads from the
    rest; streamed token by token, the same."""
    reasoning = get_reasoning_parser("openai_gptoss", tokenizer)
    whole = ChoiceOutputParser(reasoning, get_tool_parser("openai")).parse(text)
    assert whole[0] == REASONING and whole[1] == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole[2]] == calls
    streamed = ChoiceOutputParser(reasoning, get_tool_parser("openai"))
    pieces = [streamed.parse_delta(delta) for delta in token_deltas(tokenizer, text, 1)]
    held, last_calls = streamed.finish()
    assert "".join(r for r, _, _ in pieces) == REASONING
    assert "".join(c for _, c, _ in pieces) + held == (content or "")
    deltas = [d for _, _, ds in pieces for d in ds] + last_calls
    names = [d.function.name for d in deltas if d.function is not None and d.function.name]
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function is not None)
    assert names == [name for name, _ in calls]
    assert (json.loads(arguments) if arguments else None) == (calls[0][1] if calls else None)


def test_reasoning_end_from_token_ids(tokenizer: Any) -> None:
    parser = get_reasoning_parser("openai_gptoss", tokenizer)
    assert isinstance(parser, HarmonyReasoningParser)
    ids = tokenizer.encode(ANALYSIS + FINAL, add_special_tokens=False)
    messages = [i for i, token in enumerate(ids) if token == parser.message_id]
    final_starts = messages[1] + 1  # the final channel's text begins
    assert [parser.is_reasoning_end(ids[:n]) for n in (messages[0] + 1, messages[1], final_starts, len(ids))] == [
        False, False, True, True]
    # A prompt: an earlier turn's final answer, the user's message, then the assistant's header, still open.
    prompt = tokenizer.encode(FINAL + "<|end|><|start|>user<|message|>And tomorrow?<|end|><|start|>assistant",
                              add_special_tokens=False)
    assert not parser.is_reasoning_end(prompt)
    assert not parser.is_reasoning_end(tokenizer.encode(FINAL + "<|end|><|start|>user<|message|>Hi",
                                                        add_special_tokens=False))


def test_markers_must_be_single_tokens_and_the_name_a_setting() -> None:
    with pytest.raises(ValueError, match=r"openai_gptoss: the tokenizer has no single token for \['<\|channel\|>'"):
        get_reasoning_parser("openai_gptoss", build_tokenizer(500, 0))
    assert make_engine_config(model="unused", reasoning_parser="openai_gptoss").structured_outputs_config \
        .reasoning_parser == "openai_gptoss"
