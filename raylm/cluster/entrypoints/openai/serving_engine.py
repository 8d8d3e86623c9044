"""What the completion and chat endpoints share: prompt checks, sampling settings, SSE framing, gathering a
choice from delta outputs, and merging the output streams of several prompts."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.engine.outputs import CompletionOutput
from raylm.cluster.entrypoints.openai.errors import GenerationError, OpenAIError, error_from_exception
from raylm.cluster.entrypoints.openai.protocol import MAX_LOGPROBS, SamplingRequest, UsageInfo
from raylm.common.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0  # what OpenAI (and vLLM) send for -inf, which JSON cannot carry
SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def sse_error(err: Exception) -> str:
    return f"data: {error_from_exception(err).model_dump_json()}\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                     total_tokens=num_prompt_tokens + num_completion_tokens)


@dataclass
class ChoiceState:
    """One choice of a non-streamed response, gathered from its delta outputs."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, completion: CompletionOutput) -> None:
        raise_if_failed(completion)
        self.text_parts.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        self.logprobs.extend(completion.logprobs or [])
        self.finish_reason = completion.finish_reason
        self.stop_reason = completion.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class OpenAIServing:
    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def engine_prompt(self, text: str | None, token_ids: list[int], param: str, request: SamplingRequest,
                      max_tokens: int | None, max_tokens_param: str = "max_tokens") -> dict[str, Any]:
        """Checked here rather than in the engine so that a stream fails with a status, not in-band. Like vLLM's
        server (and unlike the offline LLM, which stops at max_model_len), a prompt plus max_tokens beyond
        max_model_len is refused, after truncate_prompt_tokens kept the prompt's last tokens."""
        config = self.engine.engine_config
        max_model_len, vocab_size = config.model_config.max_model_len, config.model_info.vocab_size
        assert max_model_len is not None, "the engine's config is resolved: max_model_len is set"
        keep = max_model_len if request.truncate_prompt_tokens == -1 else request.truncate_prompt_tokens
        if keep is not None and len(token_ids) > keep:
            text, token_ids = None, token_ids[-keep:]
        if not token_ids:
            raise OpenAIError(f"{param}: it is empty (0 tokens)", param=param)
        if len(token_ids) >= max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {max_model_len} tokens, and the {param} has "
                f"{len(token_ids)} tokens: it must be shorter to leave room for at least one output token",
                param=param)
        if max_tokens is not None and len(token_ids) + max_tokens > max_model_len:
            raise OpenAIError(  # vLLM's words
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {max_model_len} tokens and your request has {len(token_ids)} input tokens "
                f"({max_tokens} > {max_model_len} - {len(token_ids)}).", param=max_tokens_param)
        outside = [t for t in token_ids if not 0 <= t < vocab_size]
        if outside:
            raise OpenAIError(f"{param}: token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})",
                              param=param)
        return {"prompt": text, "prompt_token_ids": token_ids}

    @staticmethod
    def log_unknown_fields(request: SamplingRequest) -> None:
        """Fields the request models do not know are ignored, and said so (as vLLM does)."""
        if request.model_extra:
            logger.warning("the request's fields %s are not known here: ignored", sorted(request.model_extra))

    def sampling_params(self, request: SamplingRequest, max_tokens: int | None,
                        logprobs: int | None) -> SamplingParams:
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise OpenAIError(f"logprobs: must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param="logprobs")
        try:
            params = request.sampling_params(max_tokens, logprobs)
        except ValueError as err:
            # SamplingParams says "SamplingParams.<field> <rule>"; its field names are the request's.
            message = str(err).removeprefix("SamplingParams.")
            raise OpenAIError(message, param=message.split(" ", 1)[0]) from None
        vocab_size = self.engine.engine_config.model_info.vocab_size
        outside = [token for token in params.logit_bias or {} if not 0 <= token < vocab_size]
        if outside:  # checked here too, so that a stream is refused with a status
            raise OpenAIError(f"logit_bias: token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
        return params

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])


def raise_if_failed(completion: CompletionOutput) -> None:
    """GenerationError for a sequence the engine failed: one failed choice fails the response (as in vLLM), and
    leaving the output streams aborts the other choices."""
    if completion.finish_reason == "error":
        raise GenerationError(completion.error or "no reason given")


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


async def merge_async_iterators(*iterators: AsyncGenerator[T, None]) -> AsyncGenerator[tuple[int, T], None]:
    """Yields (iterator index, item) as items arrive from any of them; closing it closes them all, so that
    every request behind them is aborted."""
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for iterator in iterators:
            await iterator.aclose()
