"""The per-forward context: attention metadata and the batch's execution plan reach the layers without threading
them through every model signature. Guarded: a nested forward is a bug."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from runner.batch_descriptor import BatchDescriptor


@dataclass
class ForwardContext:
    attn_metadata: Any  # the backend's metadata object; None for a dummy run without attention
    num_tokens: int  # tokens the forward runs on, padding included
    # None outside the ModelRunner (model tests). Layers that exchange tokens across DP ranks (MoE dispatch) read
    # batch_descriptor.num_tokens_across_dp.
    batch_descriptor: BatchDescriptor | None = None


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: Any, num_tokens: int,
                        batch_descriptor: BatchDescriptor | None = None) -> Iterator[ForwardContext]:
    global _current
    assert _current is None, "nested set_forward_context: a forward is already running"
    assert batch_descriptor is None or batch_descriptor.num_tokens_padded == num_tokens
    _current = ForwardContext(attn_metadata, num_tokens, batch_descriptor)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside set_forward_context"
    return _current
