"""llguidance ("guidance" in vLLM): JSON schemas (strict: a keyword it cannot enforce is an error), regexes and Lark
grammars (EBNF in xgrammar's GBNF dialect is converted), matched lazily against the tokenizer."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import llguidance.torch
import torch

from raylm.cluster.core.structured_output.backend_types import (
    CompiledGrammar,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from raylm.cluster.core.structured_output.backend_xgrammar import parse_json
from raylm.common.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of llguidance's stubs only

_ANY_OBJECT = {"type": "object"}


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any = None, vocab_size: int = 0) -> None:
        self.ll_tokenizer = None if tokenizer is None else llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        """The constraint as llguidance's grammar text; ValueError naming the field when it cannot be."""
        kind = params.kind
        defaults: JsonCompileOptions = {"whitespace_flexible": not params.disable_any_whitespace}
        # The request's pattern wins over a schema's own "x-guidance" options (applied between the two).
        overrides: JsonCompileOptions | None = (
            None if params.whitespace_pattern is None else {"whitespace_pattern": params.whitespace_pattern})
        if kind in ("json", "json_object"):
            schema = parse_json(params.json, "json") if kind == "json" else _ANY_OBJECT
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults,
                                                                 overrides=overrides)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
        if kind == "choice":
            # Lark string literals take JSON's escapes.
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(choice) for choice in params.choice or []))
        if kind == "grammar":
            text = params.grammar or ""
            if "::=" in text:
                text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
            return llguidance.LLMatcher.grammar_from_lark(text)
        raise ValueError(f"{kind}: the guidance backend does not support structural tags; use xgrammar")

    def check(self, params: StructuredOutputsParams) -> None:
        try:
            grammar = self.grammar_text(params)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        except ValueError:
            raise
        except Exception as err:
            raise ValueError(f"{params.kind}: the guidance backend cannot compile it: {err}") from None
        if is_error or messages:
            # Warnings are what llguidance would not enforce (e.g. "Unimplemented keys"): refused as well.
            raise ValueError(f"{params.kind}: the guidance backend cannot enforce it: {'; '.join(messages)}")

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        assert self.ll_tokenizer is not None, "a backend built without a tokenizer only checks"
        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.grammar_text(params))
        if matcher.is_error():
            raise ValueError(f"{params.kind}: {matcher.get_error()}")
        return _GuidanceCompiled(matcher)


class _GuidanceCompiled(CompiledGrammar):
    """A fresh matcher, copied for each request (copying skips parsing the grammar again)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def new_grammar(self) -> StructuredOutputGrammar:
        return GuidanceGrammar(self.matcher.deep_copy())


class GuidanceGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for i, token in enumerate(tokens):
            if not self.matcher.consume_token(token):
                self.matcher.rollback(i)
                return False
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        # Not by consuming them: a token llguidance refuses puts its matcher in an error state for good.
        return tokens[: self.matcher.validate_tokens(tokens)]

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, index)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()
