"""Tool-call parsers through the OpenAI HTTP server and the official client: the model's own calls (tool_choice
"auto", its output forced into the parser's format by a regex, which auto tool choice composes with) read back
whole and streamed, the stream as vLLM sends it (a first delta with id and name, then argument pieces); a
named tool beside an auto parser; and the mistral parser keeping its special token in the text."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from raylm.cluster.entrypoints.openai.api_server import build_engine_app
from raylm.configs import make_engine_config
from tests.http_server import Server, engine_settings, wait_until
from tests.tool_model import make_tool_model

TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                "maximum": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Time in Paris and Tokyo?"}]
OUTPUT = "[get_time(zone=1), get_time(zone=9)]"  # two calls, as Llama 3.2 writes them (pythonic)
CALLS = [("get_time", {"zone": 1}), ("get_time", {"zone": 9})]


def literal_regex(text: str) -> str:
    return "".join("\\" + char if char in ".^$*+?()[]{}|\\" else char for char in text)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tool model, with Mistral's [TOOL_CALLS] as a special token (skipped from the text by default)."""
    path = make_tool_model(tmp_path_factory.mktemp("tools") / "tools")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["[TOOL_CALLS]"], special_tokens=True)
    tokenizer.save_pretrained(path)
    return path


@contextmanager
def client_for(model: Path, parser: str) -> Iterator[openai.OpenAI]:
    config = make_engine_config(**{**engine_settings(model), "max_model_len": 1024,
                                   "enable_auto_tool_choice": True, "tool_call_parser": parser})
    app, _ = build_engine_app(config)
    server = Server(app)
    try:
        wait_until(lambda: server.request("GET", "/health")[0] == 200, "the engine to load")
        yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    finally:
        server.stop()


def test_auto_calls_whole_and_streamed(tool_model: Path) -> None:
    common: dict[str, Any] = dict(model=tool_model.name, messages=MESSAGES, tools=[TIME], max_tokens=60,
                                  tool_choice="auto", temperature=0.0,
                                  extra_body={"structured_outputs": {"regex": literal_regex(OUTPUT)}})
    with client_for(tool_model, "pythonic") as client:
        whole = client.chat.completions.create(**common).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        calls = whole.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS
        assert all(c.id.startswith("call_") and c.type == "function" for c in calls)

        with client.chat.completions.stream(**common) as stream:
            chunks = [event.chunk for event in stream if event.type == "chunk"]
            final = stream.get_final_completion().choices[0]  # the client's own accumulation of the deltas
        deltas = [d for chunk in chunks if chunk.choices for d in chunk.choices[0].delta.tool_calls or []]
        for index, (name, _) in enumerate(CALLS):
            mine = [d for d in deltas if d.index == index]
            assert mine[0].id and mine[0].type == "function" and mine[0].function.name == name
            assert len(mine) > 1 and all(d.id is None and d.function.name is None for d in mine[1:])
        assert all(not c.choices[0].delta.content for c in chunks if c.choices)
        assert final.finish_reason == "tool_calls" and not final.message.content
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []] == [
            (c.function.name, c.function.arguments) for c in calls]

        # A named tool takes its grammar, whatever the auto parser (as "required" does).
        named = {"type": "function", "function": {"name": "get_time"}}
        forced = dict(common, extra_body={}, tool_choice=named, max_tokens=30,
                      logit_bias={str(t): -100 for t in _whitespace(tool_model)})
        with client.chat.completions.stream(**forced) as stream:
            final = stream.get_final_completion().choices[0]
        assert [c.function.name for c in final.message.tool_calls or []] == ["get_time"]
        assert final.finish_reason == "tool_calls"


def test_mistral_keeps_its_special_token_in_the_text(tool_model: Path) -> None:
    """[TOOL_CALLS] is a special token: the server keeps special tokens in the text for the mistral parser (unless
    the request says otherwise), so an output that is only the marker comes back as that text."""
    marker = AutoTokenizer.from_pretrained(tool_model).convert_tokens_to_ids("[TOOL_CALLS]")
    common: dict[str, Any] = dict(model=tool_model.name, messages=MESSAGES, tools=[TIME], tool_choice="auto",
                                  max_tokens=1, temperature=0.0, logit_bias={str(marker): 100})
    with client_for(tool_model, "mistral") as client:
        assert client.chat.completions.create(**common).choices[0].message.content == "[TOOL_CALLS]"
        skipped = client.chat.completions.create(**common, extra_body={"skip_special_tokens": True})
        assert skipped.choices[0].message.content == ""


def _whitespace(model: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    return [t for t in range(len(tokenizer)) if tokenizer.decode([t]).isspace()]
