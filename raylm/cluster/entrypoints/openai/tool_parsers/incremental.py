"""Tool parsers that re-read the text so far on every delta: a format says what its text holds (content and calls,
as far as they are known), and the stream sends what grew since the last delta, as vLLM sends it: a call's first
delta with its id, type and name, then pieces of its arguments text."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

from raylm.cluster.entrypoints.openai.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from raylm.cluster.entrypoints.openai.tool_parsers.abstract import ExtractedToolCalls, ToolParser, new_tool_call_id
from raylm.cluster.entrypoints.openai.tool_parsers.json_scan import is_json_object


@dataclass
class PartialCall:
    name: str
    arguments: str  # the arguments' JSON text written so far


Segment = str | PartialCall


def content_of(segments: list[Segment]) -> str:
    """The content: text before the first call as written, text after one without its surrounding whitespace (the
    newlines between calls are not an answer). Both only ever grow as the text grows."""
    pieces: list[str] = []
    after_call = False
    for segment in segments:
        if isinstance(segment, PartialCall):
            after_call = True
        else:
            pieces.append(segment.strip() if after_call else segment)
    return "".join(pieces)


def rest_is_text(text: str, start: int, position: int, segments: list[Segment]) -> list[Segment]:
    """Not a call where one should be, at position: after a call the rest is text; with none before, all of the
    calls block (from start) is."""
    if any(isinstance(segment, PartialCall) for segment in segments):
        return [*segments, text[position:]]
    return [*segments, text[start:]]


class IncrementalToolParser(ToolParser):
    def __init__(self) -> None:
        self._text = ""
        self._content_sent = 0
        self._arguments_sent: list[int] = []  # per call streamed: characters of its arguments sent

    @abstractmethod
    def parse(self, text: str, final: bool) -> list[Segment]:
        """The text as content and calls, in order. Until `final`, text that may still turn out to be part of a call
        is left out, a call appears once its name is known, and every segment only grows as the text does."""

    def new_call_id(self) -> str:
        return new_tool_call_id()

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        segments = self.parse(model_output, final=True)
        calls = [segment for segment in segments if isinstance(segment, PartialCall)]
        if not calls:
            return ExtractedToolCalls(content_of(segments))
        if not all(is_json_object(call.arguments) for call in calls):
            return ExtractedToolCalls(model_output)  # cut short or malformed: the text is the answer
        return ExtractedToolCalls(content_of(segments).strip() or None, [
            ToolCall(id=self.new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in calls])

    def extract_tool_calls_streaming(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        self._text += delta_text
        return self._advance(final=False)

    def finish_streaming(self) -> tuple[str, list[DeltaToolCall]]:
        return self._advance(final=True)

    @property
    def num_calls_streamed(self) -> int:
        return len(self._arguments_sent)

    def _advance(self, final: bool) -> tuple[str, list[DeltaToolCall]]:
        segments = self.parse(self._text, final)
        content = content_of(segments)
        new_content, self._content_sent = content[self._content_sent:], len(content)
        deltas = []
        calls = [segment for segment in segments if isinstance(segment, PartialCall)]
        for index, call in enumerate(calls):
            if index == len(self._arguments_sent):
                deltas.append(DeltaToolCall(index=index, id=self.new_call_id(), type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                self._arguments_sent.append(len(call.arguments))
            elif len(call.arguments) > self._arguments_sent[index]:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                    arguments=call.arguments[self._arguments_sent[index]:])))
                self._arguments_sent[index] = len(call.arguments)
        return new_content, deltas
