"""Hermes tool calls (Qwen2.5, Qwen3, Hermes 2/3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, after any plain text."""
from __future__ import annotations

import json
import re

from raylm.cluster.entrypoints.openai.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from raylm.cluster.entrypoints.openai.tool_parsers.abstract import ExtractedToolCalls, ToolParser, new_tool_call_id

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_call(body: str) -> FunctionCall | None:
    """{"name", "arguments"} -> the call, arguments as JSON text; None when it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return FunctionCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))


class HermesToolParser(ToolParser):
    def __init__(self) -> None:
        self._buffer = ""  # text not yet sent: a possible start of a call, or a call not yet closed
        self._in_call = False
        self._num_calls = 0

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        if START not in model_output:
            return ExtractedToolCalls(model_output)
        calls = [parse_call(body.strip()) for body in _BLOCK.findall(model_output)]
        if not calls or any(call is None for call in calls):
            return ExtractedToolCalls(model_output)  # not well-formed calls: the text is the answer
        content = model_output[: model_output.index(START)].strip()
        return ExtractedToolCalls(content or None, [ToolCall(id=new_tool_call_id(), function=call)
                                                    for call in calls if call is not None])

    def extract_tool_calls_streaming(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        self._buffer += delta_text
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(END)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(END):]
                self._in_call = False
                call = parse_call(body.strip())
                if call is None:
                    content.append(START + body + END)  # not a call after all: send it as text
                else:
                    calls.append(self._delta(call))
                continue
            start = self._buffer.find(START)
            if start >= 0:
                content.append(self._buffer[:start])
                self._buffer, self._in_call = self._buffer[start + len(START):], True
                continue
            keep = _partial_suffix(self._buffer, START)
            content.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return "".join(content), calls

    def finish_streaming(self) -> tuple[str, list[DeltaToolCall]]:
        buffer, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            call = parse_call(buffer.strip())
            return ("", [self._delta(call)]) if call is not None else (START + buffer, [])
        return buffer, []

    @property
    def num_calls_streamed(self) -> int:
        return self._num_calls

    def _delta(self, call: FunctionCall) -> DeltaToolCall:
        delta = DeltaToolCall(index=self._num_calls, id=new_tool_call_id(), type="function",
                              function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
        self._num_calls += 1
        return delta


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that starts the marker (it may complete in the next delta)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
