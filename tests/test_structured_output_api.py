"""Structured output and tools through the OpenAI API, driven by the official client: response_format (a pydantic
model through `chat.completions.parse`, json_object), vLLM's structured_outputs field and its guided_* aliases, 400s
that name the field, tool_choice required / named / auto (hermes) whole and streamed through the client's stream
helpers, and a reasoning parser that keeps the grammar off the reasoning."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from transformers import AutoTokenizer

from raylm.cluster.entrypoints.openai.api_server import build_engine_app
from raylm.configs import make_engine_config
from tests.http_server import Server, engine_settings, wait_until
from tests.structured_corpus import CORPUS, UNSUPPORTED, closing_bias, validate_json
from tests.tool_model import make_tool_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 14}},
                                       "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


class Pet(BaseModel):
    name: str
    kind: Literal["cat", "dog"]
    tags: list[str]


@contextmanager
def serve(model: Path, **settings: Any) -> Iterator[Server]:
    app, _ = build_engine_app(make_engine_config(**{**engine_settings(model), "max_model_len": 1024, **settings}))
    server = Server(app)
    try:
        wait_until(lambda: server.request("GET", "/health")[0] == 200, "the engine to load")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tool_model(tmp_path_factory.mktemp("tools") / "qwen-tools")


@pytest.fixture(scope="module")
def server(tool_model: Path) -> Iterator[Server]:
    with serve(tool_model, enable_auto_tool_choice=True, tool_call_parser="hermes") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def bias(tool_model: Path) -> dict[str, float]:
    """Closing tokens up, whitespace-only tokens down: complete JSON from a random model (see structured_corpus)."""
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    bias = closing_bias(tokenizer, tokenizer.eos_token_id)
    for token_id in range(len(tokenizer)):
        if tokenizer.decode([token_id]).isspace():
            bias[token_id] = -100.0
    return {str(token): value for token, value in bias.items()}


def test_parse_returns_the_pydantic_object(client: openai.OpenAI, tool_model: Path, bias: dict) -> None:
    completion = client.chat.completions.parse(model=tool_model.name, messages=MESSAGES, response_format=Pet,
                                               max_tokens=120, temperature=0.0, logit_bias=bias)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Pet) and completion.choices[0].finish_reason == "stop"


def test_json_object_and_schemas_by_every_field(client: openai.OpenAI, tool_model: Path, bias: dict) -> None:
    common: dict[str, Any] = dict(model=tool_model.name, messages=MESSAGES, max_tokens=150, temperature=0.0,
                                  logit_bias=bias)
    text = client.chat.completions.create(**common, response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(text or ""), dict)
    schema = CORPUS["github_issue"]
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": schema}):
        content = client.chat.completions.create(**common, extra_body=extra).choices[0].message.content
        validate_json(content or "", schema)
    regex = client.completions.create(model=tool_model.name, prompt="Code:", max_tokens=20, temperature=0.0,
                                      extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"}).choices[0].text
    assert len(regex) == 6 and regex[3] == "-"
    for extra in ({"guided_choice": ["up", "down"]}, {"structured_outputs": {"choice": ["up", "down"]}}):
        assert client.chat.completions.create(**common, extra_body=extra).choices[0].message.content in ("up", "down")


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNSUPPORTED["not"]}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_json": {"type": "string"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_uncompilable_or_conflicting_constraints_are_400(server: Server, tool_model: Path, body: dict,
                                                         param: str) -> None:
    status, reply = server.request("POST", "/v1/chat/completions",
                                   {"model": tool_model.name, "messages": MESSAGES, **body})
    assert status == 400 and reply["error"]["param"] == param, reply
    assert reply["error"]["message"].startswith(param)


def test_auto_tool_choice_needs_the_server_flags(llama_path: Path) -> None:
    with serve(llama_path) as server:
        status, reply = server.request("POST", "/v1/chat/completions", {
            "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "auto"})
        assert status == 400 and "--enable-auto-tool-choice" in reply["error"]["message"]
        # Without tool_choice, tools go to the template and nothing is parsed.
        status, reply = server.request("POST", "/v1/chat/completions",
                                       {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 4})
        assert status == 200 and reply["choices"][0]["message"]["tool_calls"] == []


def check_calls(calls: list[Any], tools: list[dict]) -> None:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_whole_and_streamed(client: openai.OpenAI, tool_model: Path, bias: dict,
                                              tool_choice: Any) -> None:
    common: dict[str, Any] = dict(model=tool_model.name, messages=MESSAGES, tools=[WEATHER, TIME],
                                  tool_choice=tool_choice, max_tokens=150, temperature=0.0, logit_bias=bias)
    whole = client.chat.completions.create(**common).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    check_calls(whole.message.tool_calls or [], [WEATHER, TIME])
    with client.chat.completions.stream(**common) as stream:
        final = stream.get_final_completion().choices[0]
    streamed = final.message.tool_calls or []
    check_calls(streamed, [WEATHER, TIME])
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert final.finish_reason == "tool_calls"


def test_auto_tool_choice_parses_hermes_calls(client: openai.OpenAI, tool_model: Path) -> None:
    """The model's own call (here forced by a regex, which auto tool choice composes with) is read back."""
    common: dict[str, Any] = dict(model=tool_model.name, messages=MESSAGES, tools=[WEATHER], tool_choice="auto",
                                  max_tokens=250, temperature=0.0, extra_body={"structured_outputs": {
                                      "regex": "Let me check\\." + json.dumps(HERMES_CALL)[1:-1]
                                      .replace("{", "\\{").replace("}", "\\}")}})
    whole = client.chat.completions.create(**common).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    check_calls(whole.message.tool_calls or [], [WEATHER])
    assert json.loads((whole.message.tool_calls or [])[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    with client.chat.completions.stream(**common) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.content == "Let me check."
    assert [c.function.arguments for c in final.message.tool_calls or []] == [
        c.function.arguments for c in whole.message.tool_calls or []]


def test_reasoning_then_grammar(tool_model: Path) -> None:
    """deepseek_r1: the output is reasoning until </think>; the grammar applies only after it."""
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    end_think = tokenizer.convert_tokens_to_ids("</think>")
    with serve(tool_model, reasoning_parser="deepseek_r1") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        common: dict[str, Any] = dict(model=tool_model.name, messages=MESSAGES, max_tokens=20, temperature=0.0,
                                      logit_bias={str(end_think): 40}, extra_body={"guided_choice": ["yes", "no"]})
        message = client.chat.completions.create(**common).choices[0].message
        assert message.content in ("yes", "no")  # a grammar applied from the start would forbid </think>
        assert getattr(message, "reasoning_content", None) is None
        chunks = list(client.chat.completions.create(**common, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == message.content


SPACED = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "zone": {"type": "integer"}},
          "required": ["unit", "zone"], "additionalProperties": False}  # no free text: all whitespace is the pattern's


def test_guided_whitespace_pattern_is_the_whitespace_between_json_tokens(client: openai.OpenAI, tool_model: Path,
                                                                         bias: dict) -> None:
    """vLLM's guided_whitespace_pattern, through llguidance's JSON option: with spaces pushed up, the flexible
    default takes runs of them; the pattern " " allows one at a time, and a newline-only one none."""
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    spaces = {str(t): 30.0 for t in range(len(tokenizer)) if set(tokenizer.decode([t])) == {" "}}
    common: dict[str, Any] = dict(model=tool_model.name, messages=MESSAGES, max_tokens=60, temperature=0.0,
                                  logit_bias={**bias, **spaces})
    texts = {}
    for pattern in (None, " ", "\n"):
        extra = {"guided_json": SPACED, **({} if pattern is None else {"guided_whitespace_pattern": pattern})}
        choice = client.chat.completions.create(**common, extra_body=extra).choices[0]
        texts[pattern] = choice.message.content or ""
        if pattern is not None:
            assert choice.finish_reason == "stop"
            validate_json(texts[pattern], SPACED)
    assert "  " in texts[None]
    assert " " in texts[" "] and "  " not in texts[" "]
    assert " " not in texts["\n"]


def test_guided_decoding_backend_picks_the_backend(client: openai.OpenAI, server: Server, tool_model: Path,
                                                   bias: dict) -> None:
    common: dict[str, Any] = dict(model=tool_model.name, messages=MESSAGES, max_tokens=40, temperature=0.0,
                                  logit_bias=bias)
    multiple_of = {"type": "integer", "multipleOf": 3}  # xgrammar would not enforce it: auto takes guidance
    for backend in ("auto", "guidance"):
        content = client.chat.completions.create(**common, extra_body={
            "guided_json": multiple_of, "guided_decoding_backend": backend}).choices[0].message.content
        assert int(content or "1") % 3 == 0
    refusals = [
        ({"guided_json": multiple_of, "guided_decoding_backend": "xgrammar"}, "guided_json",
         "xgrammar backend does not enforce multipleOf"),
        ({"structured_outputs": {"json": multiple_of, "disable_fallback": True}}, "structured_outputs",
         "xgrammar backend does not enforce multipleOf"),
        ({"structured_outputs": {"structural_tag": '{"structures": [], "triggers": []}'},
          "guided_decoding_backend": "guidance"}, "structured_outputs", "guidance backend does not support"),
        ({"guided_regex": "a+", "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
         "'outlines' is not a grammar backend of this engine (its structured_outputs_backend is 'auto'); use one of "
         "'auto', 'xgrammar', 'guidance'"),
        ({"guided_decoding_backend": "xgrammar:no-fallback"}, "guided_decoding_backend", "'xgrammar:no-fallback'"),
        ({"guided_json": SPACED, "guided_whitespace_pattern": " ", "guided_decoding_backend": "xgrammar"},
         "guided_json", "the xgrammar backend takes no whitespace_pattern"),
        ({"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
         "applies to JSON output"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "this request has no output constraint"),
        ({"guided_json": SPACED, "guided_whitespace_pattern": 3}, "guided_whitespace_pattern", "must be a string"),
    ]
    for body, param, message in refusals:
        status, reply = server.request("POST", "/v1/chat/completions",
                                       {"model": tool_model.name, "messages": MESSAGES, **body})
        assert status == 400 and reply["error"]["param"] == param and message in reply["error"]["message"], reply
