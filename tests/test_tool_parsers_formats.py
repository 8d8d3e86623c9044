"""Every tool-call parser (vLLM's names) on outputs written in its model's real format: single and parallel calls,
text before a call, malformed output left as content; parsed whole and streamed in small pieces, giving the same
calls, with arguments streamed as pieces after a first delta that carries the id, type and name."""
from __future__ import annotations

import json
import random
from typing import Any, get_args

import pytest

from raylm.cluster.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from raylm.cluster.entrypoints.openai.tool_parsers.incremental import IncrementalToolParser, PartialCall, content_of
from raylm.configs import make_engine_config
from raylm.configs.structured_outputs_config import StructuredOutputsConfig

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"zone": 2})
TRICKY = ("search", {"query": "a \"quoted\" }] {[", "filters": {"tags": ["x", "y"], "exact": True}, "limit": None})


def hermes(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def llama(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "parameters": arguments})


def deepseek(name: str, arguments: dict) -> str:
    return (f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(arguments)}\n```"
            "<｜tool▁call▁end｜>")


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def harmony(name: str, arguments: dict) -> str:
    return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>" + \
        json.dumps(arguments) + "<|call|>"


THINK = "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"

# parser -> [(case, model output, content of the whole parse, calls)]
CASES: dict[str, list[tuple[str, str, str | None, list[tuple[str, dict]]]]] = {
    "hermes": [
        ("one", hermes(*WEATHER), None, [WEATHER]),
        ("text before", "Let me check the weather.\n" + hermes(*WEATHER), "Let me check the weather.", [WEATHER]),
        ("parallel", hermes(*WEATHER) + "\n" + hermes(*TIME), None, [WEATHER, TIME]),
        ("tricky strings", hermes(*TRICKY), None, [TRICKY]),
        ("no arguments", '<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", {})]),
        ("plain", "It is sunny in Paris <tool", "It is sunny in Paris <tool", []),
        ("malformed", "<tool_call>\nnot a call\n</tool_call>", "<tool_call>\nnot a call\n</tool_call>", []),
    ],
    "llama3_json": [
        ("one", llama(*WEATHER), None, [WEATHER]),
        ("python tag", "<|python_tag|>" + llama(*TIME), None, [TIME]),
        ("parallel", llama(*WEATHER) + "; " + llama(*TIME), None, [WEATHER, TIME]),
        ("arguments key", json.dumps({"name": TRICKY[0], "arguments": TRICKY[1]}), None, [TRICKY]),
        ("text before is text", "Sure! " + llama(*WEATHER), "Sure! " + llama(*WEATHER), []),
        ("plain", "It is sunny.", "It is sunny.", []),
        ("json without a name", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ],
    "mistral": [
        ("array", "[TOOL_CALLS] [" + json.dumps({"name": WEATHER[0], "arguments": WEATHER[1]}) + "]", None,
         [WEATHER]),
        ("array parallel", "[TOOL_CALLS] [" + ", ".join(json.dumps({"name": n, "arguments": a})
                                                       for n, a in (WEATHER, TIME)) + "]", None, [WEATHER, TIME]),
        ("v11", "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER[1]), None, [WEATHER]),
        ("v11 parallel", "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER[1]) + "[TOOL_CALLS]get_time[ARGS]"
         + json.dumps(TIME[1]), None, [WEATHER, TIME]),
        ("call id", "[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]" + json.dumps(TRICKY[1]), None, [TRICKY]),
        ("text before", "Let me look.[TOOL_CALLS]get_time[ARGS]" + json.dumps(TIME[1]), "Let me look.", [TIME]),
        ("plain", "No tools [TOOL", "No tools [TOOL", []),
        ("malformed", "[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),
    ],
    "pythonic": [
        ("one", '[get_weather(city="Paris", unit="celsius")]', None, [WEATHER]),
        ("parallel", "[get_weather(city='Paris', unit='celsius'), get_time(zone=2)]", None, [WEATHER, TIME]),
        ("llama4 tags", "<|python_start|>[get_time(zone=2)]<|python_end|>", None, [TIME]),
        ("literals", '[search(query="a \\"quoted\\" }] {[", filters={"tags": ["x", "y"], "exact": True}, '
                     "limit=None)]", None, [TRICKY]),
        ("no arguments", "[get_time()]", None, [("get_time", {})]),
        ("text before is text", 'I will call [get_time(zone=2)]', 'I will call [get_time(zone=2)]', []),
        ("a list, not calls", "[1, 2, 3] are odd and even", "[1, 2, 3] are odd and even", []),
    ],
    "deepseek_v3": [
        ("one", DS_BEGIN + deepseek(*WEATHER) + DS_END, None, [WEATHER]),
        ("parallel", DS_BEGIN + deepseek(*WEATHER) + deepseek(*TIME) + DS_END, None, [WEATHER, TIME]),
        ("tricky strings", DS_BEGIN + deepseek(*TRICKY) + DS_END, None, [TRICKY]),
        ("text before", "Let me check.\n\n" + DS_BEGIN + deepseek(*TIME) + DS_END, "Let me check.", [TIME]),
        ("plain", "It is sunny.", "It is sunny.", []),
        ("malformed", DS_BEGIN + "oops" + DS_END, DS_BEGIN + "oops" + DS_END, []),
    ],
    "openai": [
        ("one", THINK + harmony(*WEATHER), None, [WEATHER]),
        ("recipient in the role", THINK + "<|start|>assistant to=functions.get_time<|channel|>commentary json"
         "<|message|>" + json.dumps(TIME[1]) + "<|call|>", None, [TIME]),
        ("parallel", THINK + harmony(*WEATHER) + harmony(*TRICKY), None, [WEATHER, TRICKY]),
        ("preamble before", "<|channel|>commentary<|message|>Let me check.<|end|>" + harmony(*TIME),
         "Let me check.", [TIME]),
        ("final answer", THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
         "It is sunny.", []),
        ("plain", "It is sunny.", "It is sunny.", []),
    ],
}
PARAMS = [pytest.param(parser, *case[1:], id=f"{parser}-{case[0]}") for parser, cases in CASES.items()
          for case in cases]


def stream(parser_name: str, text: str, size: int) -> tuple[str, list[Any]]:
    """The text fed `size` characters at a time: (content sent, tool-call deltas sent)."""
    parser = get_tool_parser(parser_name)
    content, deltas = [], []
    for start in range(0, len(text), size):
        piece, calls = parser.extract_tool_calls_streaming(text[start: start + size])
        content.append(piece)
        deltas += calls
    piece, calls = parser.finish_streaming()
    assert parser.num_calls_streamed == len({d.index for d in deltas + calls})
    return "".join(content) + piece, deltas + calls


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), PARAMS)
def test_whole_and_streamed_give_the_same_calls(parser_name: str, text: str, content: str | None,
                                                calls: list[tuple[str, dict]]) -> None:
    whole = get_tool_parser(parser_name).extract_tool_calls(text)
    assert whole.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == calls
    for size in (1, 3, len(text)):
        streamed_content, deltas = stream(parser_name, text, size)
        if not calls:
            assert streamed_content == whole.content and deltas == []
            continue
        assert streamed_content.strip() == (content or "")
        firsts = {}
        for delta in deltas:  # the first delta of each call names it; the others only add arguments
            if delta.index not in firsts:
                assert delta.index == len(firsts) and delta.type == "function" and delta.id and delta.function.name
                firsts[delta.index] = delta
            else:
                assert delta.id is None and delta.function.name is None
        arguments = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in range(len(calls))]
        # Byte for byte the whole parse's arguments, so a client's accumulated call is the same either way.
        assert arguments == [c.function.arguments for c in whole.tool_calls]
        assert [firsts[i].function.name for i in range(len(calls))] == [name for name, _ in calls]
        if size == 1:  # the arguments stream as they are written, not in one piece at the end
            assert all(sum(1 for d in deltas if d.index == i) > 1 for i in range(len(calls)) if calls[i][1])


@pytest.mark.parametrize("parser_name", sorted(CASES))
def test_cut_short_call_is_content_when_whole(parser_name: str) -> None:
    """max_tokens in the middle of the arguments: the whole output is text (no call with broken JSON)."""
    text = next(t for case, t, _, c in CASES[parser_name] if case in ("one", "array"))
    cut = text[: text.index("Paris") + 3]
    assert get_tool_parser(parser_name).extract_tool_calls(cut).content == cut
    assert get_tool_parser(parser_name).extract_tool_calls(cut).tool_calls == []


def test_mistral_ids_are_nine_alphanumerics() -> None:
    """Mistral's chat templates reject other ids when the call is sent back in the next turn."""
    call = get_tool_parser("mistral").extract_tool_calls(CASES["mistral"][2][1]).tool_calls[0]
    assert len(call.id) == 9 and call.id.isalnum()
    _, deltas = stream("mistral", CASES["mistral"][2][1], 4)
    assert len(deltas[0].id) == 9 and deltas[0].id.isalnum()


def test_unknown_parser_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown parser 'qwen25'.*deepseek_v3.*hermes.*llama3_json.*mistral"):
        get_tool_parser("qwen25")
    assert set(CASES) <= set(TOOL_PARSERS)


def test_every_parser_is_a_setting() -> None:
    """The engine setting accepts exactly the registered parsers, and names them when refusing another."""
    literal = get_args(StructuredOutputsConfig.model_fields["tool_call_parser"].annotation)[0]
    assert set(get_args(literal)) == set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="tool_call_parser: Input should be 'hermes', 'llama3_json', 'mistral'"):
        make_engine_config(model="unused", enable_auto_tool_choice=True, tool_call_parser="qwen25")


@pytest.mark.parametrize("parser_name", sorted(CASES))
def test_any_text_streams_without_taking_anything_back(parser_name: str) -> None:
    """Pieces of recorded outputs glued at random (broken calls, stray markers): the parser never raises, and what
    it has sent (content, each call's name and arguments) is always the start of what it reads from more text, so
    a stream never has to take back a delta."""
    rng = random.Random(0)
    texts = [text for _, text, _, _ in CASES[parser_name]]
    fragments = [text[a:b] for text in texts for a, b in
                 (sorted((rng.randrange(len(text) + 1), rng.randrange(len(text) + 1))) for _ in range(20))]
    fragments += list('{}[]()",:; \n\\=<|>')
    parser = TOOL_PARSERS[parser_name]()
    assert isinstance(parser, IncrementalToolParser)
    for _ in range(150):
        text = "".join(rng.choice(fragments) for _ in range(rng.randrange(1, 10)))
        sent, sent_calls = "", []
        for end, final in [*((end, False) for end in range(len(text) + 1)), (len(text), True)]:
            segments = parser.parse(text[:end], final)
            content, calls = content_of(segments), [s for s in segments if isinstance(s, PartialCall)]
            assert content.startswith(sent) and len(calls) >= len(sent_calls), text[:end]
            for before, now in zip(sent_calls, calls):
                assert now.name == before.name and now.arguments.startswith(before.arguments), text[:end]
            sent, sent_calls = content, calls
        parser.extract_tool_calls(text)
