"""The per-forward context: attention metadata reaches the attention layers without threading it
through every model signature. Guarded: a nested forward is a bug."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: Any  # the backend's metadata object; None for a dummy run without attention
    num_tokens: int


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: Any, num_tokens: int) -> Iterator[ForwardContext]:
    global _current
    assert _current is None, "nested set_forward_context: a forward is already running"
    _current = ForwardContext(attn_metadata, num_tokens)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside set_forward_context"
    return _current
