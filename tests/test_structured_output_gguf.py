"""Structured output on GGUF files, the default model's format (issue #39): the grammar is compiled against the
engine's tokenizer, read from the file's metadata (there is no tokenizer.json beside it). On GGUF files the test
writes: a JSON schema, a regex, a choice and a forced tool call give valid output; it is token-exact with the
unconstrained run wherever the mask allows that run's argmax; a float32 GGUF gives the text the float32 folder it
was written from gives. Then the default model itself (SmolLM2 Q4_1), when scripts/fetch_default_model.py fetched it."""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import jsonschema
import openai
import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.core.structured_output.backend_xgrammar import XgrammarBackend
from raylm.cluster.entrypoints.openai.api_server import build_engine_app
from raylm.cluster.entrypoints.openai.forced_tool_calls import required_schema
from raylm.cluster.entrypoints.openai.protocol_tools import ChatCompletionTool
from raylm.cluster.models.default_gguf import default_gguf_path
from raylm.common.structured_outputs import StructuredOutputsParams
from raylm.configs import make_engine_config
from raylm.configs.gguf_metadata import get_tokenizer
from tests.gguf_files import write_gguf
from tests.http_server import Server, engine_settings, wait_until
from tests.structured_corpus import CORPUS, closing_bias, validate_json

Q = gguf.GGMLQuantizationType
ENGINE = dict(max_model_len=256, block_size=16, enforce_eager=True)
PROMPTS = ["The city of", "A list of", "Once upon a time", "Numbers:"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TOOL_CALLS = required_schema([ChatCompletionTool.model_validate(WEATHER)], parallel_tool_calls=False)
REGEX = r"[a-z]{2,5}-[0-9]{2,3}"
# (constraint, check of the text): the kinds a user meets first, the forced tool call as the server builds it.
CASES: dict[str, tuple[dict[str, Any], Callable[[str], Any]]] = {
    "json_schema": (dict(json=CORPUS["weather_tool"]), lambda text: validate_json(text, CORPUS["weather_tool"])),
    "regex": (dict(regex=REGEX), lambda text: re.fullmatch(REGEX, text)),
    "choice": (dict(choice=["red", "green", "blue sky"]), lambda text: text in ("red", "green", "blue sky")),
    "tool_call": (dict(json=TOOL_CALLS), lambda text: validate_json(text, TOOL_CALLS)),
}


def _gguf(checkpoint: Path, folder: Path, linear: Q, embedding: Q = Q.Q8_0) -> Path:
    # Alone in its folder: a tokenizer loaded from the file's path finds no tokenizer.json.
    return write_gguf(checkpoint, folder / f"llama-{linear.name}.gguf", linear, embedding)


@pytest.fixture(scope="module")
def llm(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    llm = LLM(model=str(_gguf(llama_path, tmp_path_factory.mktemp("q4"), Q.Q4_1)), **ENGINE)
    yield llm
    llm.shutdown()


def constrained(llm: LLM, constraint: dict[str, Any], max_tokens: int = 80) -> SamplingParams:
    tokenizer = llm.get_tokenizer()
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          logit_bias=closing_bias(tokenizer, tokenizer.eos_token_id),
                          structured_outputs=StructuredOutputsParams(**constraint, disable_any_whitespace=True))


def test_every_kind_is_valid_on_a_quantized_gguf(llm: LLM) -> None:
    names = list(CASES)
    params = [constrained(llm, CASES[name][0]) for name in names]
    for name, output in zip(names, llm.generate(PROMPTS, params, use_tqdm=False)):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.finish_reason, completion.stop_reason)
        assert CASES[name][1](completion.text), (name, completion.text)


def test_token_exact_where_the_mask_allows_the_argmax(llm: LLM) -> None:
    """A grammar that allows any text leaves greedy decoding as it was, but where it forbids the argmax (a byte that
    is not valid UTF-8); a choice whose first option is the unconstrained text gives that text, token for token."""
    prompts = [*PROMPTS, "She said", "In the morning the", "The old river", "A dog and a"]
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    anything = StructuredOutputsParams(regex=r"[\s\S]*")
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=anything),
                           use_tqdm=False)
    tokenizer, engine = llm.get_tokenizer(), llm.llm_engine
    backend = XgrammarBackend(tokenizer, engine.model_info.vocab_size, sorted(engine.eos_token_ids))
    num_equal = 0
    for ours, reference in zip(outputs, plain):
        tokens, expected = ours.outputs[0].token_ids, reference.outputs[0].token_ids
        diverged = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if diverged is None:
            num_equal += 1
            assert tokens == expected
            continue
        grammar = backend.compile(anything).new_grammar()
        assert grammar.accept_tokens("check", list(tokens[:diverged]))
        bitmask = torch.zeros(1, -(-engine.model_info.vocab_size // 32), dtype=torch.int32)
        grammar.fill_bitmask(bitmask, 0)
        token = expected[diverged]
        assert not (int(bitmask[0, token // 32]) >> (token % 32)) & 1, (tokens, expected)
    assert num_equal >= 1
    for prompt, reference in zip(prompts, plain):
        prefix = reference.outputs[0].token_ids[:6]
        text = tokenizer.decode(prefix)
        if "\ufffd" in text:
            continue  # a partial UTF-8 byte: no string names it
        params = SamplingParams(temperature=0.0, max_tokens=16,
                                structured_outputs=StructuredOutputsParams(choice=[text, "zzz"]))
        completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert completion.text == text and completion.token_ids[:len(prefix)] == prefix


def test_a_float32_gguf_gives_the_text_of_its_float32_folder(llama_path: Path,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same weights and vocabulary by two paths: one grammar, one output (the token ids differ only in the stop
    token: the folder's generation_config adds <|end|> to the stop tokens, which the file does not declare)."""
    path = _gguf(llama_path, tmp_path_factory.mktemp("f32"), Q.F32, Q.F32)
    texts = []
    for model in (path, llama_path):
        llm = LLM(model=str(model), **ENGINE)
        params = [constrained(llm, constraint) for constraint, _ in CASES.values()]
        texts.append([(o.outputs[0].text, o.outputs[0].finish_reason)
                      for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        llm.shutdown()
    assert texts[0] == texts[1]
    assert all(reason == "stop" and CASES[name][1](text) for name, (text, reason) in zip(CASES, texts[0]))


def test_forced_tool_calls_and_json_schema_over_http(llama_path: Path,
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    path = _gguf(llama_path, tmp_path_factory.mktemp("http"), Q.Q8_0)
    app, _ = build_engine_app(make_engine_config(**engine_settings(path)))
    server = Server(app)
    try:
        wait_until(lambda: server.request("GET", "/health")[0] == 200, "the engine to load")
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        tokenizer = get_tokenizer(path)
        bias = closing_bias(tokenizer, tokenizer.eos_token_id)
        for token_id in range(len(tokenizer)):
            if tokenizer.decode([token_id]).isspace():
                bias[token_id] = -100.0  # the tool-call grammar allows any whitespace: a random model takes it
        common: dict[str, Any] = dict(model=path.name, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                      max_tokens=80, temperature=0.0,
                                      logit_bias={str(t): b for t, b in bias.items()})
        for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            choice = client.chat.completions.create(**common, tools=[WEATHER], tool_choice=tool_choice).choices[0]
            assert choice.finish_reason == "tool_calls", choice
            for call in choice.message.tool_calls or []:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
            assert choice.message.tool_calls
        schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": CORPUS["weather_tool"]}}
        choice = client.chat.completions.create(**common, response_format=schema).choices[0]
        assert choice.finish_reason == "stop"
        validate_json(choice.message.content or "", CORPUS["weather_tool"])
    finally:
        server.stop()


@pytest.mark.skipif(default_gguf_path() is None, reason="the default model is not fetched "
                                                       "(scripts/fetch_default_model.py fetches it)")
def test_the_default_model() -> None:
    llm = LLM(model=str(default_gguf_path()), **ENGINE)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
               for text in ("Describe the weather in Paris as JSON.", "Write a product code.",
                            "Pick a colour.", "What is the weather in Paris?")]
    params = [constrained(llm, constraint, max_tokens=60) for constraint, _ in CASES.values()]
    for name, output in zip(CASES, llm.generate(prompts, params, use_tqdm=False)):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.finish_reason, completion.stop_reason)
        assert CASES[name][1](completion.text), (name, completion.text)
    llm.shutdown()
