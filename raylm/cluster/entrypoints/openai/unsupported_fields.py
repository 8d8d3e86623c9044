"""vLLM's (and OpenAI's) request fields that raylm does not implement: each accepted only at the value that changes
nothing (or null), so that /openapi.json says so and any other value is a 400 naming the field and why, never a value
taken and silently ignored. The request models inherit these mixins (protocol.py)."""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, WithJsonSchema


def only(value: Any, why: str) -> Any:
    """A field accepted only as `value` (a JSON scalar; None: only null) or null."""

    def check(given: Any) -> Any:
        # JSON's equality: 1 is 1.0, true is not 1.
        same_type = (isinstance(given, int | float) and not isinstance(given, bool) if isinstance(value, float)
                     else type(given) is type(value))
        if given is not None and not (same_type and given == value):
            allowed = "null" if value is None else f"{json.dumps(value)} (or null)"
            raise ValueError(f"{json.dumps(given)} is not supported, only {allowed}: {why}")
        return given

    schema: dict[str, Any] = ({"type": "null"} if value is None
                              else {"anyOf": [{"const": value}, {"type": "null"}]})
    return Annotated[Any, AfterValidator(check), WithJsonSchema({**schema, "description": f"unsupported: {why}"})]


_NO_BEAM_SEARCH = "raylm has no beam search"
_NOT_YET = "not implemented in raylm"
_UseBeamSearch = only(False, _NO_BEAM_SEARCH)
_LengthPenalty = only(1.0, _NO_BEAM_SEARCH + " (length_penalty applies to it only)")
_SpacesBetweenSpecialTokens = only(True, "special tokens are detokenized as the tokenizer writes them")
_PromptLogprobs = only(None, _NOT_YET + " over HTTP (the offline SamplingParams.prompt_logprobs is)")
_AllowedTokenIds = only(None, _NOT_YET + "; use logit_bias")
_BadWords = only(None, _NOT_YET + "; use logit_bias")
_LogitsProcessors = only(None, "the server loads no code named by requests")
_ReturnTokensAsTokenIds = only(None, _NOT_YET)
_ReturnTokenIds = only(None, _NOT_YET)
_RequestId = only(None, "the server names each request itself")
_CacheSalt = only(None, _NOT_YET)
_VllmXargs = only(None, _NOT_YET)
_Echo = only(False, _NOT_YET)
_Suffix = only(None, "raylm has no fill-in-the-middle")
_PromptEmbeds = only(None, _NOT_YET + "; give the prompt as text or token ids")
_ChatTemplate = only(None, "the server does not take chat templates from requests (vLLM's default)")
_Documents = only(None, _NOT_YET)
_MmProcessorKwargs = only(None, "raylm serves text models only")
_IncludeReasoning = only(True, _NOT_YET + ": reasoning_content is always returned with a reasoning parser")
_ReasoningEffort = only(None, _NOT_YET + "; pass chat_template_kwargs to a template that reads it")
_Functions = only(None, "OpenAI's deprecated form: use tools")
_FunctionCall = only(None, "OpenAI's deprecated form: use tool_choice")


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
