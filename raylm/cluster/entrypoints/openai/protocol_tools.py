"""The wire format of constrained output and tools: response_format, vLLM's structured_outputs field (and its older
guided_* names), tools and tool_choice, and the tool calls and reasoning a response carries."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, strict=True)


class JsonSchemaFormat(_Model):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Model):
    """vLLM's `structured_outputs` body field: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None  # JSON: the whitespace allowed between tokens (guidance backend)
    disable_fallback: bool = False  # the engine's first backend or a 400, never the next one


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Model):
    name: str | None = Field(None, exclude_if=lambda value: value is None)
    arguments: str | None = None


class DeltaToolCall(_Model):
    index: int
    id: str | None = Field(None, exclude_if=lambda value: value is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda value: value is None)
    function: DeltaFunctionCall
