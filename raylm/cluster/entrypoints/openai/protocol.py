"""The OpenAI wire format: pydantic models of requests and responses.

Sampling fields include vLLM's extensions (top_k, min_p, ignore_eos, min_tokens, repetition_penalty, ...); vLLM's
fields raylm does not implement are refused at any value that would change something (unsupported_fields.py).
Other fields are accepted, ignored and logged, as vLLM does (load tools send extras). Over 300 lines: one schema,
read as a whole (vLLM's protocol.py is one file too); the messages and refused fields have files of their own.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, WithJsonSchema
from pydantic.config import JsonDict

from raylm.cluster.entrypoints.openai.protocol_messages import ChatMessage
from raylm.cluster.entrypoints.openai.protocol_tools import (
    ChatCompletionTool,
    DeltaToolCall,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCall,
    ToolChoice,
)
from raylm.cluster.entrypoints.openai.unsupported_fields import (
    UnsupportedChatFields,
    UnsupportedCompletionFields,
    UnsupportedSamplingFields,
)
from raylm.common.sampling_params import FLOAT32_MAX, FLOAT32_MIN_POSITIVE, SamplingParams

_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "include_stop_str_in_output",
    "skip_special_tokens",
)


MAX_LOGPROBS = 20
MAX_N = 128  # OpenAI's cap on choices per request: one request cannot fill the engine's queue
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
T = TypeVar("T")


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer; strict parsing alone would refuse it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


_INTEGRAL = BeforeValidator(_integral)  # after any Field(...) constraints, so that the schema states them
JsonInt = Annotated[int, _INTEGRAL]
NonEmptyList = Annotated[list[T], Field(min_length=1)]
_TOKEN_ID = r"^-?[0-9]+$"
# Token ids as keys; the schema says that no other key is allowed (pydantic alone would not).
# Biases in OpenAI's range [-100, 100].
TokenBias = Annotated[
    dict[Annotated[str, StringConstraints(pattern=_TOKEN_ID)], Annotated[float, Field(ge=-100.0, le=100.0)]],
    WithJsonSchema({"type": "object", "patternProperties": {_TOKEN_ID: {"type": "number", "minimum": -100,
                                                                        "maximum": 100}},
                    "additionalProperties": False})]
_CheckedString = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "null"}]})]
# Requests are parsed strictly: a value of the wrong JSON type (true for an integer, "1" for a number) is refused as
# the schema says, not coerced.
_REQUEST_CONFIG = ConfigDict(extra="allow", strict=True)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- requests -----------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    model_config = _REQUEST_CONFIG
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingRequest(OpenAIBaseModel, UnsupportedSamplingFields):
    """The fields completions and chat share; None (or null) means the engine's default."""

    model_config = _REQUEST_CONFIG

    model: str | None = None
    user: str | None = None  # OpenAI's end-user id, for its abuse monitoring: nothing for the engine to do
    # The ranges SamplingParams checks, stated here so that /openapi.json says them.
    n: Annotated[int, Field(ge=1, le=MAX_N), _INTEGRAL] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N), _INTEGRAL] | None = Field(
        None, description="no beam search or reranking: only equal to n (the n sequences are the best_of)")
    # The prompt's last k tokens (vLLM's); -1: its last max_model_len tokens.
    truncate_prompt_tokens: Literal[-1] | Annotated[int, Field(ge=1), _INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0.0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=-1), _INTEGRAL] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: JsonInt | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0), _INTEGRAL]] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=FLOAT32_MIN_POSITIVE, le=FLOAT32_MAX)
    logit_bias: TokenBias | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0), _INTEGRAL] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: JsonInt | None = None  # with scheduling_policy "priority": smaller is served first
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: to the engine's KV connector (disaggregated prefill)
    # Constrained output (structured_request.py reads whichever is given): at most one of these.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    # The whitespace a JSON constraint allows; one of the engine's grammar backends, or "auto". Checked, with their
    # type, by structured_request.py.
    guided_whitespace_pattern: _CheckedString = None
    guided_decoding_backend: _CheckedString = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError on out-of-range values."""
        settings = {name: value for name in _SAMPLING_FIELDS if (value := getattr(self, name)) is not None}
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError(f"SamplingParams.best_of must equal n ({self.n or 1}), got {self.best_of}: raylm has no "
                             f"beam search or reranking; ask for n sequences")
        if self.logit_bias:
            try:
                settings["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids") from None
        if self.kv_transfer_params is not None:
            settings["extra_args"] = {"kv_transfer_params": self.kv_transfer_params}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **settings)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's extension), only with include_usage."""
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)


class CompletionRequest(SamplingRequest, UnsupportedCompletionFields):
    # An empty prompt is refused, as vLLM does.
    prompt: NonEmptyStr | NonEmptyList[NonEmptyStr] | NonEmptyList[JsonInt] | NonEmptyList[NonEmptyList[JsonInt]]
    add_special_tokens: bool = True  # the tokenizer's BOS (and such) around a text prompt
    max_tokens: Annotated[int, Field(ge=1), _INTEGRAL] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _INTEGRAL] | None = None


# Rules across fields that the server enforces, stated for /openapi.json (vLLM's rules).
_CHAT_RULES: JsonDict = {"allOf": [
    {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
     "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
    {"if": {"required": ["continue_final_message"], "properties": {"continue_final_message": {"const": True}}},
     "then": {"required": ["add_generation_prompt"], "properties": {"add_generation_prompt": {"const": False}}}},
]}


class ChatCompletionRequest(SamplingRequest, UnsupportedChatFields):
    model_config = _REQUEST_CONFIG | ConfigDict(json_schema_extra=_CHAT_RULES)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1), _INTEGRAL] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), _INTEGRAL] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _INTEGRAL] | None = None  # with logprobs: true
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the template leaves the last (assistant) message open, to be continued
    add_special_tokens: bool = False  # the template writes the special tokens itself
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # False: at most one call


# ---- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # A prefill's (kv_producer): where a decode engine takes its KV; absent otherwise.
    kv_transfer_params: dict[str, Any] | None = Field(None, exclude_if=lambda params: params is None)


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprob] = Field(default_factory=list)


class AssistantMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, exclude_if=lambda value: value is None)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(OpenAIBaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    # A prefill's (kv_producer): where a decode engine takes its KV; absent otherwise.
    kv_transfer_params: dict[str, Any] | None = Field(None, exclude_if=lambda params: params is None)


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda role: role is None)  # first delta only
    content: str | None = None
    reasoning_content: str | None = Field(None, exclude_if=lambda value: value is None)
    tool_calls: list[DeltaToolCall] = Field(default_factory=list, exclude_if=lambda calls: not calls)


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "raylm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo
