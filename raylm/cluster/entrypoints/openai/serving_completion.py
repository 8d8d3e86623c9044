"""POST /v1/completions: one or several prompts (text or token ids), each with n choices."""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import cast

from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.entrypoints.openai.errors import OpenAIError
from raylm.cluster.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from raylm.cluster.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChoiceState,
    OpenAIServing,
    clamp_logprob,
    merge_async_iterators,
    raise_if_failed,
    random_id,
    sse,
    sse_error,
    usage,
)
from raylm.cluster.entrypoints.openai.structured_request import request_constraint

_Outputs = AsyncGenerator[tuple[int, RequestOutput], None]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncGenerator[str, None]:
        await self.engine.wait_until_ready()
        self.log_unknown_fields(request)
        prompts = [self.engine_prompt(text, ids, "prompt", request, request.max_tokens)
                   for text, ids in self._tokenize(request.prompt, request.add_special_tokens)]
        params = self.sampling_params(request, request.max_tokens, request.logprobs)
        params.structured_outputs = request_constraint(request, self.engine.engine_config).structured_outputs
        request_id = random_id("cmpl")
        priority = request.priority or 0
        # Deltas even when not streamed: the server's metrics time every token (a final-only output has no ITL).
        outputs = merge_async_iterators(*[self.engine.generate(f"{request_id}-{i}", prompt, params, priority)
                                          for i, prompt in enumerate(prompts)])
        if request.stream:
            return self._stream(request, request_id, params.n, outputs)
        return await self._collect(request, request_id, params.n, outputs)

    def _tokenize(self, prompt: str | list[str] | list[int] | list[list[int]],
                  add_special_tokens: bool) -> list[tuple[str | None, list[int]]]:
        one = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))  # a string or token ids
        prompts = cast(list[str | list[int]], [prompt] if one else prompt)
        if not prompts:
            raise OpenAIError("prompt: give a string, a list of strings, or token ids", param="prompt")
        tokenizer = self.engine.tokenizer
        return [(p, tokenizer.encode(p, add_special_tokens=add_special_tokens)) if isinstance(p, str)
                else (None, list(p)) for p in prompts]

    async def _collect(self, request: CompletionRequest, request_id: str, n: int,
                       outputs: _Outputs) -> CompletionResponse:
        choices: dict[int, ChoiceState] = {}
        num_prompt_tokens: dict[int, int] = {}
        kv_transfer_params = None
        async with aclosing(outputs):
            async for prompt_index, output in outputs:
                num_prompt_tokens[prompt_index] = len(output.prompt_token_ids)
                kv_transfer_params = output.kv_transfer_params or kv_transfer_params
                for completion in output.outputs:
                    choices.setdefault(prompt_index * n + completion.index, ChoiceState()).add(completion)
        response_choices = [
            CompletionChoice(index=index, text=choice.text,
                             logprobs=self._logprobs(choice.token_ids, choice.logprobs, request.logprobs, 0),
                             finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
            for index, choice in sorted(choices.items())]
        num_completion_tokens = sum(len(choice.token_ids) for choice in choices.values())
        return CompletionResponse(id=request_id, model=self.model_name, choices=response_choices,
                                  usage=usage(sum(num_prompt_tokens.values()), num_completion_tokens),
                                  kv_transfer_params=kv_transfer_params)

    async def _stream(self, request: CompletionRequest, request_id: str, n: int,
                      outputs: _Outputs) -> AsyncGenerator[str, None]:
        created = int(time.time())
        num_prompt_tokens: dict[int, int] = {}
        num_completion_tokens = 0
        text_offsets: dict[int, int] = {}  # choice index -> characters streamed so far
        try:
            async with aclosing(outputs):
                async for prompt_index, output in outputs:
                    num_prompt_tokens[prompt_index] = len(output.prompt_token_ids)
                    choices = []
                    for completion in output.outputs:
                        raise_if_failed(completion)
                        index = prompt_index * n + completion.index
                        num_completion_tokens += len(completion.token_ids)
                        logprobs = self._logprobs(completion.token_ids, completion.logprobs or [], request.logprobs,
                                                  text_offsets.get(index, 0))
                        text_offsets[index] = text_offsets.get(index, 0) + len(completion.text)
                        choices.append(CompletionChoice(
                            index=index, text=completion.text, logprobs=logprobs,
                            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))
                    chunk_usage = None
                    if request.continuous_usage:
                        chunk_usage = usage(sum(num_prompt_tokens.values()), num_completion_tokens)
                    yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                                 choices=choices, usage=chunk_usage))
            if request.include_usage:
                yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                             usage=usage(sum(num_prompt_tokens.values()), num_completion_tokens)))
        except Exception as err:
            yield sse_error(err)
        yield SSE_DONE

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int | None,
                  text_offset: int) -> CompletionLogProbs | None:
        """vLLM's entries: each position's top_logprobs holds the sampled token first, then the top num_top, so n + 1
        entries when the sampled token is not among the top n, else n."""
        if num_top is None:
            return None
        result = CompletionLogProbs()
        for token_id, candidates in zip(token_ids, logprobs):
            token = self.token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(clamp_logprob(candidates[token_id]))
            result.top_logprobs.append({self.token_text(top_id): clamp_logprob(logprob)
                                        for top_id, logprob in list(candidates.items())[:num_top + 1]})
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

