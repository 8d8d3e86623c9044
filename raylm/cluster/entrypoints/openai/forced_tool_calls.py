"""Tool calls forced by a grammar (tool_choice "required" or a named function), as vLLM builds them: a named call's
output is its arguments object; a required call's output is a JSON array of {"name", "parameters"}, one per call.
Both read back as tool calls, whole or streamed."""
from __future__ import annotations

import json
from typing import Any

from raylm.cluster.entrypoints.openai.protocol_tools import (
    ChatCompletionTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from raylm.cluster.entrypoints.openai.tool_parsers import ExtractedToolCalls, ToolParser, new_tool_call_id
from raylm.common.structured_outputs import StructuredOutputsParams

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(tool: ChatCompletionTool) -> dict[str, Any]:
    return tool.function.parameters or _NO_PARAMETERS


def required_schema(tools: list[ChatCompletionTool], parallel_tool_calls: bool) -> dict[str, Any]:
    """An array of one or more calls of the given tools, each with parameters valid for that tool."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                             "parameters": parameters_schema(tool)},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else
                              {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class NamedToolCallParser(ToolParser):
    """The output is the arguments of one call of `name`: streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(None, [ToolCall(id=new_tool_call_id(),
                                                  function=FunctionCall(name=self.name, arguments=model_output))])

    def extract_tool_calls_streaming(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        if self._started:
            return "", [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta_text))] if delta_text else []
        self._started = True
        return "", [DeltaToolCall(index=0, id=new_tool_call_id(), type="function",
                                  function=DeltaFunctionCall(name=self.name, arguments=delta_text))]

    def finish_streaming(self) -> tuple[str, list[DeltaToolCall]]:
        return "", [] if self._started else self.extract_tool_calls_streaming("")[1]

    @property
    def num_calls_streamed(self) -> int:
        return int(self._started)


class RequiredToolCallParser(ToolParser):
    """The output is a JSON array of calls: each is sent once its object closes."""

    def __init__(self) -> None:
        self._text = ""
        self._scanned = 0  # characters of _text already scanned
        self._depth = 0
        self._in_string = self._escaped = False
        self._element_start = -1
        self._num_calls = 0

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        try:
            calls = json.loads(model_output)
        except json.JSONDecodeError:
            return ExtractedToolCalls(model_output)  # cut short (max_tokens): no calls to report
        return ExtractedToolCalls(None, [ToolCall(id=new_tool_call_id(), function=_function_call(call))
                                         for call in calls])

    def extract_tool_calls_streaming(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        self._text += delta_text
        deltas = []
        for i in range(self._scanned, len(self._text)):
            char = self._text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                continue
            if char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._element_start = i
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1 and char == "}":
                    call = _function_call(json.loads(self._text[self._element_start: i + 1]))
                    deltas.append(DeltaToolCall(index=self._num_calls, id=new_tool_call_id(), type="function",
                                                function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                    self._num_calls += 1
        self._scanned = len(self._text)
        return "", deltas

    def finish_streaming(self) -> tuple[str, list[DeltaToolCall]]:
        return "", []

    @property
    def num_calls_streamed(self) -> int:
        return self._num_calls


def _function_call(call: dict[str, Any]) -> FunctionCall:
    return FunctionCall(name=call["name"], arguments=json.dumps(call["parameters"], ensure_ascii=False))


def forced_tool_constraint(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None
                           ) -> StructuredOutputsParams | None:
    """The grammar of an offline chat's tool_choice (`LLM.chat`), as the server builds it: "required" -> an array of
    calls, a named function -> its arguments; None / "auto" / "none" -> no grammar."""
    if tool_choice in (None, "auto", "none"):
        return None
    parsed = [ChatCompletionTool.model_validate(tool) for tool in tools]
    if tool_choice == "required":
        if not parsed:
            raise ValueError("tool_choice 'required' needs tools")
        return StructuredOutputsParams(json=required_schema(parsed, parallel_tool_calls=True))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    named = next((tool for tool in parsed if tool.function.name == name), None)
    if named is None:
        raise ValueError(f"tool_choice {tool_choice!r}: expected 'none', 'auto', 'required' or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}} naming one of the tools "
                         f"{[tool.function.name for tool in parsed]}")
    return StructuredOutputsParams(json=parameters_schema(named))
