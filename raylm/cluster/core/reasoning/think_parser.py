"""The <think>...</think> format (vLLM's deepseek_r1 and qwen3 parsers). The markers must be single tokens, so the
engine can tell from token ids alone when the reasoning has ended (and the request's grammar starts to apply)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

START, END = "<think>", "</think>"


class ReasoningParser:
    """`deepseek_r1`: the output is reasoning until </think> (the template may open <think> itself); `qwen3`: there is
    reasoning only between an explicit <think> and </think>."""

    reads_special_tokens: ClassVar[bool] = False  # whether its markers are special tokens the server must keep

    def __init__(self, name: str, tokenizer: Any) -> None:
        if name not in ("deepseek_r1", "qwen3"):
            raise ValueError(f"reasoning_parser: unknown parser {name!r}; known: deepseek_r1, qwen3, openai_gptoss")
        self.name = name
        vocab = tokenizer.get_vocab()
        missing = [marker for marker in (START, END) if marker not in vocab]
        if missing:
            raise ValueError(f"reasoning_parser {name}: the tokenizer has no single token for {missing}")
        self.start_token_id, self.end_token_id = vocab[START], vocab[END]

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """The last think marker in token_ids closes the reasoning."""
        for token_id in reversed(token_ids):
            if token_id == self.end_token_id:
                return True
            if token_id == self.start_token_id:
                return False
        return False

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output, split as the stream splits it: for qwen3, text before
        <think> (and all of it without one, a stray </think> included) is content."""
        before = ""
        if self.name == "qwen3":
            before, found, text = text.partition(START)
            if not found:
                return None, before
        reasoning, _, content = text.partition(END)
        return reasoning.replace(START, "", 1) or None, before + content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(in_reasoning=self.name == "deepseek_r1")


@dataclass
class ReasoningStream:
    """Splits streamed text deltas; the markers arrive whole (single tokens), never split between deltas."""

    in_reasoning: bool
    ended: bool = False

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta)."""
        reasoning, content = [], []
        while delta:
            if self.ended:
                content.append(delta)
                break
            if not self.in_reasoning:
                if START in delta:
                    before, delta = delta.split(START, 1)
                    content.append(before)
                    self.in_reasoning = True
                    continue
                content.append(delta)
                break
            before, found, after = delta.partition(END)
            reasoning.append(before.replace(START, "", 1))
            if not found:
                break
            self.ended, delta = True, after
        return "".join(reasoning), "".join(content)

