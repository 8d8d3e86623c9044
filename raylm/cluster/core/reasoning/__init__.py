"""Reasoning parsers: where a model's reasoning ends, and its text split into reasoning and content: <think>...</think>
(deepseek_r1, qwen3) and GPT-OSS's harmony channels (openai_gptoss)."""
from __future__ import annotations

from typing import Any

from raylm.cluster.core.reasoning.harmony_parser import HarmonyReasoningParser
from raylm.cluster.core.reasoning.think_parser import ReasoningParser, ReasoningStream

__all__ = ["HarmonyReasoningParser", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]


def get_reasoning_parser(name: str | None, tokenizer: Any) -> ReasoningParser | None:
    if name is None:
        return None
    return HarmonyReasoningParser(tokenizer) if name == "openai_gptoss" else ReasoningParser(name, tokenizer)
