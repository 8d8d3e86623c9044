"""The hermes tool parser and the <think> reasoning parser on canned model outputs, fed token by token as a stream
delivers them: the same calls and texts as parsing the whole output at once."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from raylm.cluster.core.reasoning import ReasoningParser
from raylm.cluster.entrypoints.openai.forced_tool_calls import RequiredToolCallParser
from raylm.cluster.entrypoints.openai.tool_parsers import HermesToolParser
from tests.tool_model import make_tool_model

CALL_A = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CALL_B = '{"name": "get_time", "arguments": {"zone": 2}}'
OUTPUTS = {
    "plain": ("Just text, no calls <tool", "Just text, no calls <tool", []),
    "one call": (f"Sure.\n<tool_call>\n{CALL_A}\n</tool_call>", "Sure.", [CALL_A]),
    "two calls": (f"<tool_call>\n{CALL_A}\n</tool_call>\n<tool_call>\n{CALL_B}\n</tool_call>", None, [CALL_A, CALL_B]),
    "unclosed": (f"<tool_call>\n{CALL_B}", None, [CALL_B]),
    "not json": ("<tool_call>\nnot a call\n</tool_call>", "<tool_call>\nnot a call\n</tool_call>", []),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(make_tool_model(tmp_path_factory.mktemp("parsers") / "model"))


def token_deltas(tokenizer: AutoTokenizer, text: str) -> list[str]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, previous = [], ""
    for end in range(1, len(ids) + 1):
        current = tokenizer.decode(ids[:end])
        deltas.append(current[len(previous):])
        previous = current
    assert "".join(deltas) == text
    return deltas


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_hermes_whole_and_token_by_token(tokenizer: AutoTokenizer, name: str) -> None:
    text, content, calls = OUTPUTS[name]
    whole = HermesToolParser().extract_tool_calls(text)
    assert whole.content == content
    assert [json.loads(c.function.arguments) for c in whole.tool_calls] == [json.loads(c)["arguments"] for c in calls]
    parser, streamed_content, deltas = HermesToolParser(), [], []
    for delta in token_deltas(tokenizer, text):
        text_delta, call_deltas = parser.extract_tool_calls_streaming(delta)
        streamed_content.append(text_delta)
        deltas += call_deltas
    rest, last = parser.finish_streaming()
    streamed_content.append(rest)
    deltas += last
    # Each call: a first delta with its id and name, then its arguments in pieces.
    firsts = [d for i, d in enumerate(deltas) if d.index not in {e.index for e in deltas[:i]}]
    assert [d.index for d in firsts] == list(range(len(calls)))
    arguments = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in range(len(calls))]
    assert [(d.function.name, json.loads(a)) for d, a in zip(firsts, arguments)] == [
        (json.loads(c)["name"], json.loads(c)["arguments"]) for c in calls]
    assert all(d.id and d.id.startswith("call_") for d in firsts)
    if calls and content is not None:  # text before the first call is sent as it comes
        assert "".join(streamed_content).strip() == content
    elif not calls:
        assert "".join(streamed_content) == text


def test_required_calls_stream_as_each_object_closes(tokenizer: AutoTokenizer) -> None:
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "a\\\"}]", "unit": "celsius"}},
                       {"name": "get_time", "parameters": {"zone": -3}}])
    parser, deltas = RequiredToolCallParser(), []
    for delta in token_deltas(tokenizer, text):
        deltas += parser.extract_tool_calls_streaming(delta)[1]
    whole = parser.extract_tool_calls(text).tool_calls
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert json.loads(whole[0].function.arguments)["city"] == 'a\\"}]'


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), [
    ("deepseek_r1", "weighing it up</think>The answer", "weighing it up", "The answer"),
    ("deepseek_r1", "<think>still thinking", "still thinking", None),
    ("qwen3", "<think>hmm</think>\nDone", "hmm", "\nDone"),
    ("qwen3", "No thinking here", None, "No thinking here"),
])
def test_reasoning_whole_and_streamed(tokenizer: AutoTokenizer, name: str, text: str, reasoning: str | None,
                                      content: str | None) -> None:
    parser = ReasoningParser(name, tokenizer)
    assert parser.extract_reasoning(text) == (reasoning, content)
    stream = parser.stream()
    pieces = [stream.feed(delta) for delta in token_deltas(tokenizer, text)]
    assert "".join(r for r, _ in pieces) == (reasoning or "")
    assert "".join(c for _, c in pieces) == (content or "")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert parser.is_reasoning_end(ids) == ("</think>" in text)


def test_reasoning_parser_needs_single_token_markers(llama_path: Path) -> None:
    with pytest.raises(ValueError, match="no single token"):
        ReasoningParser("qwen3", AutoTokenizer.from_pretrained(llama_path))
