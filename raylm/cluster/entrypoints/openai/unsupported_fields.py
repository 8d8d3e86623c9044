"""vLLM's (and OpenAI's) request fields that raylm does not implement: each accepted only at the value that changes
nothing (or null), so that /openapi.json says so and any other value is a 400 naming the field and why, never a value
taken and silently ignored. The request models inherit these mixins (protocol.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, GetCoreSchemaHandler, GetJsonSchemaHandler, WithJsonSchema
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema


@dataclass(frozen=True)
class Only:
    """A field accepted only as `value` (a JSON scalar; None: only null) or null: one Annotated marker that gives
    pydantic both the check and the schema, so that the aliases below are types a type checker can read."""

    value: Any
    why: str

    def check(self, given: Any) -> Any:
        # JSON's equality: 1 is 1.0, true is not 1.
        same_type = (isinstance(given, int | float) and not isinstance(given, bool) if isinstance(self.value, float)
                     else type(given) is type(self.value))
        if given is not None and not (same_type and given == self.value):
            allowed = "null" if self.value is None else f"{json.dumps(self.value)} (or null)"
            raise ValueError(f"{json.dumps(given)} is not supported, only {allowed}: {self.why}")
        return given

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return AfterValidator(self.check).__get_pydantic_core_schema__(source, handler)

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        accepted: dict[str, Any] = ({"type": "null"} if self.value is None
                                    else {"anyOf": [{"const": self.value}, {"type": "null"}]})
        marker = WithJsonSchema({**accepted, "description": f"unsupported: {self.why}"})
        return marker.__get_pydantic_json_schema__(schema, handler)


_NO_BEAM_SEARCH = "raylm has no beam search"
_NOT_YET = "not implemented in raylm"
_UseBeamSearch = Annotated[Any, Only(False, _NO_BEAM_SEARCH)]
_LengthPenalty = Annotated[Any, Only(1.0, _NO_BEAM_SEARCH + " (length_penalty applies to it only)")]
_SpacesBetweenSpecialTokens = Annotated[Any, Only(True, "special tokens are detokenized as the tokenizer writes them")]
_PromptLogprobs = Annotated[Any, Only(None, _NOT_YET + " over HTTP (the offline SamplingParams.prompt_logprobs is)")]
_AllowedTokenIds = Annotated[Any, Only(None, _NOT_YET + "; use logit_bias")]
_BadWords = Annotated[Any, Only(None, _NOT_YET + "; use logit_bias")]
_LogitsProcessors = Annotated[Any, Only(None, "the server loads no code named by requests")]
_ReturnTokensAsTokenIds = Annotated[Any, Only(None, _NOT_YET)]
_ReturnTokenIds = Annotated[Any, Only(None, _NOT_YET)]
_RequestId = Annotated[Any, Only(None, "the server names each request itself")]
_CacheSalt = Annotated[Any, Only(None, _NOT_YET)]
_VllmXargs = Annotated[Any, Only(None, _NOT_YET)]
_Echo = Annotated[Any, Only(False, _NOT_YET)]
_Suffix = Annotated[Any, Only(None, "raylm has no fill-in-the-middle")]
_PromptEmbeds = Annotated[Any, Only(None, _NOT_YET + "; give the prompt as text or token ids")]
_ChatTemplate = Annotated[Any, Only(None, "the server does not take chat templates from requests (vLLM's default)")]
_Documents = Annotated[Any, Only(None, _NOT_YET)]
_MmProcessorKwargs = Annotated[Any, Only(None, "raylm serves text models only")]
_IncludeReasoning = Annotated[Any, Only(True, _NOT_YET + ": reasoning_content is always returned with a reasoning "
                                              "parser")]
_ReasoningEffort = Annotated[Any, Only(None, _NOT_YET + "; pass chat_template_kwargs to a template that reads it")]
_Functions = Annotated[Any, Only(None, "OpenAI's deprecated form: use tools")]
_FunctionCall = Annotated[Any, Only(None, "OpenAI's deprecated form: use tool_choice")]


class UnsupportedSamplingFields(BaseModel):
    use_beam_search: _UseBeamSearch = None
    length_penalty: _LengthPenalty = None
    spaces_between_special_tokens: _SpacesBetweenSpecialTokens = None
    prompt_logprobs: _PromptLogprobs = None
    allowed_token_ids: _AllowedTokenIds = None
    bad_words: _BadWords = None
    logits_processors: _LogitsProcessors = None
    return_tokens_as_token_ids: _ReturnTokensAsTokenIds = None
    return_token_ids: _ReturnTokenIds = None
    request_id: _RequestId = None
    cache_salt: _CacheSalt = None
    vllm_xargs: _VllmXargs = None
    echo: _Echo = None


class UnsupportedCompletionFields(BaseModel):
    suffix: _Suffix = None
    prompt_embeds: _PromptEmbeds = None


class UnsupportedChatFields(BaseModel):
    chat_template: _ChatTemplate = None
    documents: _Documents = None
    mm_processor_kwargs: _MmProcessorKwargs = None
    include_reasoning: _IncludeReasoning = None
    reasoning_effort: _ReasoningEffort = None
    functions: _Functions = None
    function_call: _FunctionCall = None
