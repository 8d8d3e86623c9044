"""The two faces of a grammar engine (vLLM's names): a backend compiles a request's constraint once per text, and a
grammar is one request's matcher over it, advanced by the tokens the request accepts."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from raylm.common.structured_outputs import StructuredOutputsParams


class StructuredOutputGrammar(ABC):
    """One request's matcher."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by tokens; False (and no advance past the first bad one) when the grammar forbids one."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of tokens the grammar allows from here; the matcher does not move."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row `index` of the int32 bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): nothing may follow."""


class CompiledGrammar(ABC):
    """A constraint compiled against the tokenizer: shared by every request with the same constraint text."""

    @abstractmethod
    def new_grammar(self) -> StructuredOutputGrammar: ...


class StructuredOutputBackend(ABC):
    name: str

    @abstractmethod
    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError, naming what is unsupported, if this backend cannot enforce the constraint exactly;
        cheap (no tokenizer): the frontend calls it on every constrained request."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint against the tokenizer (in a thread of the manager's pool)."""
