"""The logprobs entries of /v1/completions and /v1/chat/completions, exactly as vLLM builds them from the engine's
per-position {token id: logprob} (the sampled token first, then the top n; one entry fewer when the sampled token is
among the top n)."""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from raylm.cluster.entrypoints.openai.protocol import ChatCompletionRequest
from raylm.cluster.entrypoints.openai.serving_chat import OpenAIServingChat
from raylm.cluster.entrypoints.openai.serving_completion import OpenAIServingCompletion

ENGINE: Any = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: f"<{ids[0]}>"))
TOKENS = [9, 2]
POSITIONS = [{9: -4.0, 1: -0.5, 2: -1.5},  # sampled 9, outside the top 2 (1, 2)
             {2: -1.5, 1: -0.5}]  # sampled 2, itself the second of the top 2


def test_completion_entries_list_the_sampled_token_first_n_or_n_plus_1() -> None:
    logprobs = OpenAIServingCompletion(ENGINE)._logprobs(TOKENS, POSITIONS, num_top=2, text_offset=5)
    assert logprobs is not None
    assert logprobs.tokens == ["<9>", "<2>"] and logprobs.token_logprobs == [-4.0, -1.5]
    assert [list(top.items()) for top in logprobs.top_logprobs] == [
        [("<9>", -4.0), ("<1>", -0.5), ("<2>", -1.5)], [("<2>", -1.5), ("<1>", -0.5)]]
    assert logprobs.text_offset == [5, 8]
    sampled_only = OpenAIServingCompletion(ENGINE)._logprobs([9], [{9: -4.0}], num_top=0, text_offset=0)
    assert sampled_only is not None and sampled_only.top_logprobs == [{"<9>": -4.0}]


def test_chat_entries_hold_exactly_top_logprobs_the_sampled_token_first() -> None:
    def entries(top_logprobs: int | None, positions: list[dict[int, float]] = POSITIONS) -> list[dict[str, Any]]:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                        top_logprobs=top_logprobs)
        logprobs = OpenAIServingChat(ENGINE)._logprobs(request, TOKENS[:len(positions)], positions)
        assert logprobs is not None
        return [entry.model_dump() for entry in logprobs.content]

    first, second = entries(2)
    assert first == {"token": "<9>", "logprob": -4.0, "bytes": list(b"<9>"), "top_logprobs": [
        {"token": "<9>", "logprob": -4.0, "bytes": list(b"<9>")}, {"token": "<1>", "logprob": -0.5,
                                                                    "bytes": list(b"<1>")}]}
    assert [top["token"] for top in second["top_logprobs"]] == ["<2>", "<1>"]
    assert [entry["top_logprobs"] for entry in entries(None)] == [[], []]
    assert entries(1, [{9: -math.inf, 1: -0.5}])[0]["logprob"] == -9999.0  # JSON has no -inf; OpenAI's floor
