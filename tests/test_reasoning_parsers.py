"""The reasoning parsers (vLLM's deepseek_r1 and qwen3) on outputs in their models' <think> format: whole, and
streamed token by token and several tokens at a time, giving the same reasoning and content; where the reasoning
ends, read from token ids; unknown names and tokenizers without single-token markers refused by name."""
from __future__ import annotations

from typing import Any

import pytest

from raylm.cluster.core.reasoning import ReasoningParser
from raylm.cluster.models.tiny_tokenizer import build_tokenizer
from raylm.configs import make_engine_config


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tokenizer = build_tokenizer(500, 0)
    tokenizer.add_tokens(["<think>", "</think>"])  # single tokens, kept in the text, as in DeepSeek-R1 and Qwen3
    return tokenizer


CASES = [
    # DeepSeek-R1's template opens <think> in the prompt: the output is reasoning up to </think>.
    ("deepseek_r1", "The user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     "The user wants 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", "<think>\nWeighing it up.\n</think>\n\nYes.", "\nWeighing it up.\n", "\n\nYes."),
    ("deepseek_r1", "Still thinking when max_tokens", "Still thinking when max_tokens", None),
    # Qwen3 writes <think> itself; with thinking off there is none and all is content.
    ("qwen3", "<think>\nShort question.\n</think>\n\nParis.", "\nShort question.\n", "\n\nParis."),
    ("qwen3", "<think>\n\n</think>\n\nHello!", "\n\n", "\n\nHello!"),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>cut short", "cut short", None),
    ("qwen3", "A stray </think> is text.", None, "A stray </think> is text."),
    ("qwen3", "Before <think>inside</think> after", "inside", "Before  after"),
]


def token_deltas(tokenizer: Any, text: str, tokens_per_delta: int) -> list[str]:
    """The text as the detokenizer streams it, `tokens_per_delta` tokens at a time."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, previous = [], ""
    for end in [*range(tokens_per_delta, len(ids), tokens_per_delta), len(ids)]:
        current = tokenizer.decode(ids[:end])
        deltas.append(current[len(previous):])
        previous = current
    assert "".join(deltas) == text
    return deltas


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_and_streamed(tokenizer: Any, name: str, text: str, reasoning: str | None,
                            content: str | None) -> None:
    parser = ReasoningParser(name, tokenizer)
    assert parser.extract_reasoning(text) == (reasoning, content)
    for tokens_per_delta in (1, 3):
        stream = parser.stream()
        pieces = [stream.feed(delta) for delta in token_deltas(tokenizer, text, tokens_per_delta)]
        assert "".join(r for r, _ in pieces) == (reasoning or "")
        assert "".join(c for _, c in pieces) == (content or "")


def test_reasoning_end_from_token_ids(tokenizer: Any) -> None:
    parser = ReasoningParser("deepseek_r1", tokenizer)
    ids = tokenizer.encode("a<think>b</think>c", add_special_tokens=False)
    end = ids.index(parser.end_token_id)
    assert [parser.is_reasoning_end(ids[:n]) for n in (end, end + 1, len(ids))] == [False, True, True]
    # A new <think> after the end (a later turn in the prompt) opens reasoning again.
    assert not parser.is_reasoning_end(ids + [parser.start_token_id])


def test_unknown_names_list_the_known_ones(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="unknown parser 'granite'; known: deepseek_r1, qwen3, openai_gptoss"):
        ReasoningParser("granite", tokenizer)
    with pytest.raises(ValueError, match="reasoning_parser: Input should be 'deepseek_r1', 'qwen3' or 'openai_gptoss'"):
        make_engine_config(model="unused", reasoning_parser="granite")


def test_markers_must_be_single_tokens() -> None:
    with pytest.raises(ValueError, match=r"no single token for \['<think>', '</think>'\]"):
        ReasoningParser("qwen3", build_tokenizer(500, 0))
