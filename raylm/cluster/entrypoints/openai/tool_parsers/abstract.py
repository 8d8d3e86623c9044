"""The tool-parser interface (vLLM's ToolParser): a whole output split into content and tool calls, and the same done
on a stream of text deltas, one parser object per streamed choice."""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from raylm.cluster.entrypoints.openai.protocol_tools import DeltaToolCall, ToolCall


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolParser(ABC):
    # The format's markers are special tokens, which the text keeps only with skip_special_tokens off (vLLM's
    # adjust_request turns it off for such parsers unless the request sets it).
    reads_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """A whole output: its text outside the calls (None when empty) and the calls."""

    @abstractmethod
    def extract_tool_calls_streaming(self, delta_text: str) -> tuple[str, list[DeltaToolCall]]:
        """The next delta of a stream: (content to send now, tool-call deltas to send now). Text that may still turn
        out to be part of a call is held back until it is known."""

    @abstractmethod
    def finish_streaming(self) -> tuple[str, list[DeltaToolCall]]:
        """The stream ended: whatever was held back."""

    @property
    @abstractmethod
    def num_calls_streamed(self) -> int: ...
