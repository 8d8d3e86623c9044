"""POST /v1/chat/completions: messages through the tokenizer's chat template, n choices."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from raylm.cluster.core.reasoning import ReasoningParser, get_reasoning_parser
from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.entrypoints.openai.chat_output import ChoiceOutputParser
from raylm.cluster.entrypoints.openai.errors import OpenAIError
from raylm.cluster.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
)
from raylm.cluster.entrypoints.openai.serving_engine import (
    MAX_LOGPROBS,
    SSE_DONE,
    ChoiceState,
    OpenAIServing,
    clamp_logprob,
    raise_if_failed,
    random_id,
    sse,
    sse_error,
    usage,
)
from raylm.cluster.entrypoints.openai.structured_request import OutputConstraint, request_constraint


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
            self, request: ChatCompletionRequest) -> ChatCompletionResponse | AsyncGenerator[str, None]:
        await self.engine.wait_until_ready()
        self.log_unknown_fields(request)
        constraint = request_constraint(request, self.engine.engine_config)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        max_tokens_param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
        prompt = self.engine_prompt(*self._apply_chat_template(request), "messages", request, max_tokens,
                                    max_tokens_param)
        params = self.sampling_params(request, max_tokens, self._num_logprobs(request))
        params.structured_outputs = constraint.structured_outputs
        reasoning = self._reasoning_parser()
        if request.skip_special_tokens is None and (
                constraint.tool_parser is not None and constraint.tool_parser().reads_special_tokens
                or reasoning is not None and reasoning.reads_special_tokens):
            params.skip_special_tokens = False  # the markers must stay in the text (vLLM's adjust_request)
        request_id = random_id("chatcmpl")
        outputs = self.engine.generate(request_id, prompt, params, request.priority or 0)
        if request.stream:
            return self._stream(request, request_id, params.n, outputs, constraint)
        return await self._collect(request, request_id, outputs, constraint)

    def _output_parser(self, constraint: OutputConstraint) -> ChoiceOutputParser:
        return ChoiceOutputParser(self._reasoning_parser(),
                                  constraint.tool_parser() if constraint.tool_parser is not None else None)

    def _reasoning_parser(self) -> ReasoningParser | None:
        if not hasattr(self, "_reasoning"):
            name = self.engine.engine_config.structured_outputs_config.reasoning_parser
            self._reasoning = get_reasoning_parser(name, self.engine.tokenizer)
        return self._reasoning

    def _apply_chat_template(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        if request.continue_final_message and request.add_generation_prompt:
            raise OpenAIError("continue_final_message: true needs add_generation_prompt: false (the last message is "
                              "continued, not answered)", param="continue_final_message")
        tokenizer = self.engine.tokenizer
        messages = [_template_message(message) for message in request.messages]
        # Templates that take `tools` get them (as vLLM passes them); others ignore the argument.
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=request.add_generation_prompt,
                                                 continue_final_message=request.continue_final_message,
                                                 **(request.chat_template_kwargs or {}))
        except Exception as err:  # no template, or the template rejected the messages
            raise OpenAIError(f"messages: the chat template failed: {err}", param="messages") from None
        return text, tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

    def _num_logprobs(self, request: ChatCompletionRequest) -> int | None:
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise OpenAIError("top_logprobs: needs logprobs to be true", param="top_logprobs")
            if not 0 <= request.top_logprobs <= MAX_LOGPROBS:
                raise OpenAIError(f"top_logprobs: must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
        return (request.top_logprobs or 0) if request.logprobs else None

    async def _collect(self, request: ChatCompletionRequest, request_id: str,
                       outputs: AsyncGenerator[RequestOutput, None],
                       constraint: OutputConstraint) -> ChatCompletionResponse:
        choices: dict[int, ChoiceState] = {}
        num_prompt_tokens = 0
        kv_transfer_params = None
        async with aclosing(outputs):
            async for output in outputs:
                num_prompt_tokens = len(output.prompt_token_ids)
                kv_transfer_params = output.kv_transfer_params or kv_transfer_params
                for completion in output.outputs:
                    choices.setdefault(completion.index, ChoiceState()).add(completion)
        response_choices = []
        for index, choice in sorted(choices.items()):
            reasoning, content, tool_calls = self._output_parser(constraint).parse(choice.text)
            response_choices.append(ChatChoice(
                index=index, message=AssistantMessage(content=content, reasoning_content=reasoning,
                                                      tool_calls=tool_calls),
                logprobs=self._logprobs(request, choice.token_ids, choice.logprobs),
                finish_reason=_finish_reason(choice.finish_reason, bool(tool_calls)), stop_reason=choice.stop_reason))
        num_completion_tokens = sum(len(choice.token_ids) for choice in choices.values())
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=response_choices,
                                      usage=usage(num_prompt_tokens, num_completion_tokens),
                                      kv_transfer_params=kv_transfer_params)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, n: int,
                      outputs: AsyncGenerator[RequestOutput, None],
                      constraint: OutputConstraint) -> AsyncGenerator[str, None]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], num_prompt_tokens: int = 0,
                  num_completion_tokens: int = 0, with_usage: bool = False) -> str:
            chunk_usage = usage(num_prompt_tokens, num_completion_tokens) if with_usage else None
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices,
                                           usage=chunk_usage))

        num_prompt_tokens = num_completion_tokens = 0
        parsers = [self._output_parser(constraint) for _ in range(n)]
        try:
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(n)])
            async with aclosing(outputs):
                async for output in outputs:
                    num_prompt_tokens = len(output.prompt_token_ids)
                    choices = []
                    for completion in output.outputs:
                        raise_if_failed(completion)
                        num_completion_tokens += len(completion.token_ids)
                        parser = parsers[completion.index]
                        reasoning, content, tool_calls = parser.parse_delta(completion.text)
                        if completion.finish_reason is not None:
                            rest, more_calls = parser.finish()
                            content, tool_calls = content + rest, tool_calls + more_calls
                        delta = DeltaMessage(content=content if content or not (reasoning or tool_calls) else None,
                                             reasoning_content=reasoning or None, tool_calls=tool_calls)
                        choices.append(ChatStreamChoice(
                            index=completion.index, delta=delta,
                            logprobs=self._logprobs(request, completion.token_ids, completion.logprobs or []),
                            finish_reason=_finish_reason(completion.finish_reason, parser.called_tools),
                            stop_reason=completion.stop_reason))
                    yield chunk(choices, num_prompt_tokens, num_completion_tokens, request.continuous_usage)
            if request.include_usage:
                yield chunk([], num_prompt_tokens, num_completion_tokens, with_usage=True)
        except Exception as err:
            yield sse_error(err)
        yield SSE_DONE

    def _logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                  logprobs: list[dict[int, float]]) -> ChatLogprobs | None:
        """vLLM's entries: top_logprobs holds exactly top_logprobs entries, the sampled token first, then the top
        ones (so the last of the top n drops out when the sampled token is not among them)."""
        if not request.logprobs:
            return None
        num_top = request.top_logprobs or 0
        content = []
        for token_id, candidates in zip(token_ids, logprobs):
            top = [self._top_logprob(top_id, logprob) for top_id, logprob in list(candidates.items())[:num_top]]
            sampled = self._top_logprob(token_id, candidates[token_id])
            content.append(ChatLogprob(**sampled.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text(token_id)
        return TopLogprob(token=token, logprob=clamp_logprob(logprob), bytes=list(token.encode("utf-8")))


def _finish_reason(finish_reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and finish_reason == "stop" else finish_reason


def _template_message(message: Any) -> dict[str, Any]:
    """A message as chat templates read it: text content; tool calls with their arguments parsed (templates write
    them out as JSON themselves)."""
    entry: dict[str, Any] = {"role": message.role, "content": message.text()}
    if getattr(message, "tool_calls", None):
        entry["tool_calls"] = [
            {"id": call.id, "type": call.type,
             "function": {"name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
            for call in message.tool_calls]
    for name in ("tool_call_id", "name"):
        if getattr(message, name, None) is not None:
            entry[name] = getattr(message, name)
    return entry


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
