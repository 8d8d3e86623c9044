"""A constrained request's grammar state in the engine: the compile in flight, then its own matcher."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from raylm.cluster.core.structured_output.backend_types import CompiledGrammar, StructuredOutputGrammar
from raylm.common.structured_outputs import StructuredOutputsParams


@dataclass
class StructuredOutputRequest:
    params: StructuredOutputsParams
    compiled: Future[CompiledGrammar]
    # With a reasoning parser: whether the prompt already closed the reasoning, asked once the grammar is ready.
    reasoning_ended_in_prompt: Callable[[], bool] | None = None
    grammar: StructuredOutputGrammar | None = None  # the matcher, once compiled
    # With a reasoning parser the grammar applies only once the reasoning has ended.
    reasoning_ended: bool = True

    def is_ready(self) -> bool:
        """Whether the grammar is compiled; a failed compile is ready too (error() says why)."""
        if self.grammar is not None:
            return True
        if not self.compiled.done():
            return False
        if self.compiled.exception() is None:
            self.grammar = self.compiled.result().new_grammar()
            if self.reasoning_ended_in_prompt is not None:
                self.reasoning_ended = self.reasoning_ended_in_prompt()
        return True

    def error(self) -> str | None:
        if not self.compiled.done() or self.compiled.exception() is None:
            return None
        return f"{self.params.kind}: the grammar failed to compile: {self.compiled.exception()}"
