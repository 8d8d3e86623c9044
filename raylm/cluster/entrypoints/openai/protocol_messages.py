"""The messages of a chat request, by role (OpenAI's roles only), each with the fields OpenAI requires of it: a
message without a known role, or without its content (an assistant turn: its content or its tool calls), is a 400
that names it, as /openapi.json says."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raylm.cluster.entrypoints.openai.protocol_tools import ToolCall

# As every request model (protocol.py): extra fields kept, JSON types not coerced.
_CONFIG = ConfigDict(extra="allow", strict=True)


class TextContentPart(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]  # raylm serves text models: an image or audio part is refused, not dropped
    text: str


MessageContent = str | list[TextContentPart]


class _Message(BaseModel):
    model_config = _CONFIG
    name: str | None = None
    content: MessageContent | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class SystemMessage(_Message):
    role: Literal["system"]
    content: MessageContent


class DeveloperMessage(_Message):
    role: Literal["developer"]
    content: MessageContent


class UserMessage(_Message):
    role: Literal["user"]
    content: MessageContent


class AssistantTurn(_Message):
    """An earlier assistant turn: its content, or the tools it called, or both (as OpenAI requires)."""

    model_config = _CONFIG | ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]})
    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> AssistantTurn:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Message):
    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str  # the call it answers


ChatMessage = Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantTurn | ToolMessage,
                        Field(discriminator="role")]
