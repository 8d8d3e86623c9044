"""One chat choice's text read back as the message the client sees: reasoning (with a reasoning parser), then tool
calls (with a tool parser) and content; whole, or delta by delta while streaming."""
from __future__ import annotations

from raylm.cluster.core.reasoning import ReasoningParser
from raylm.cluster.entrypoints.openai.protocol_tools import DeltaToolCall, ToolCall
from raylm.cluster.entrypoints.openai.tool_parsers import ToolParser


class ChoiceOutputParser:
    def __init__(self, reasoning: ReasoningParser | None, tool_parser: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.reasoning_stream = reasoning.stream() if reasoning is not None else None
        self.tool_parser = tool_parser

    def parse(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning_content, content, tool_calls) of a whole output."""
        reasoning_content: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            reasoning_content, content = self.reasoning.extract_reasoning(text)
        if self.tool_parser is None or content is None:
            return reasoning_content, content, []
        extracted = self.tool_parser.extract_tool_calls(content)
        return reasoning_content, extracted.content, extracted.tool_calls

    def parse_delta(self, delta: str) -> tuple[str, str, list[DeltaToolCall]]:
        """(reasoning delta, content delta, tool-call deltas) of the next text delta."""
        reasoning, content = "", delta
        if self.reasoning_stream is not None:
            reasoning, content = self.reasoning_stream.feed(delta)
        if self.tool_parser is None:
            return reasoning, content, []
        content, calls = self.tool_parser.extract_tool_calls_streaming(content)
        return reasoning, content, calls

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """What was held back, at the end of the stream."""
        return self.tool_parser.finish_streaming() if self.tool_parser is not None else ("", [])

    @property
    def called_tools(self) -> bool:
        return self.tool_parser is not None and self.tool_parser.num_calls_streamed > 0
