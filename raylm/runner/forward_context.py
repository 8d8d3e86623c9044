"""The per-forward context: attention metadata and the batch's execution plan reach the layers without threading
them through every model signature. Guarded: a nested forward is a bug. Per thread, so that the two micro-batches
of a dual-batch-overlap forward (runner/ubatching.py), one per thread, each see their own."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from raylm.runner.batch_descriptor import BatchDescriptor


@dataclass
class ForwardContext:
    attn_metadata: Any  # the backend's metadata object; None for a dummy run without attention
    num_tokens: int  # tokens the forward (or this micro-batch of it) runs on, padding included
    # None outside the ModelRunner (model tests). The whole forward's plan, shared by its micro-batches.
    batch_descriptor: BatchDescriptor | None = None
    kv_connector: Any = None  # the worker-side KV connector the attention layers call, if the engine has one
    # The sliding layers' metadata where the KV cache splits in two groups (configs/kv_cache_groups.py), else None.
    sliding_attn_metadata: Any = None


class _Current(threading.local):
    context: ForwardContext | None = None


_current = _Current()


@contextmanager
def set_forward_context(attn_metadata: Any, num_tokens: int, batch_descriptor: BatchDescriptor | None = None,
                        kv_connector: Any = None, sliding_attn_metadata: Any = None) -> Iterator[ForwardContext]:
    assert _current.context is None, "nested set_forward_context: a forward is already running"
    assert (batch_descriptor is None or batch_descriptor.num_tokens_padded == num_tokens
            or batch_descriptor.should_ubatch), "a forward context covers the whole padded batch or one micro-batch"
    _current.context = context = ForwardContext(attn_metadata, num_tokens, batch_descriptor, kv_connector,
                                                sliding_attn_metadata)
    try:
        yield context
    finally:
        _current.context = None


def current_forward_context() -> ForwardContext | None:
    """The running forward's context, or None outside one (a layer called on its own, in a test)."""
    return _current.context


def get_forward_context() -> ForwardContext:
    context = _current.context
    assert context is not None, "attention ran outside set_forward_context"
    return context
