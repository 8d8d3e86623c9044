"""The attention layer of a model: owns its KV cache (assigned by the runner) and runs whatever backend built
the current step's metadata. A layer with a sliding window or a logit soft-cap passes them to the backend on each
call; the resolver picked a backend that has them (configs/attention_backends.py), and a plain layer passes neither,
so a backend without them (flash_attn) keeps its signature."""
from __future__ import annotations

import torch
from torch import nn

from raylm.runner.attention.backend import AttentionMetadata
from raylm.runner.attention.torch_backend import attend
from raylm.runner.forward_context import get_forward_context
from raylm.runner.kv_transfer.base import kv_layer_name


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 layer_idx: int = 0, sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.features: dict[str, int | float] = {  # keyword arguments of the backend's forward
            name: value for name, value in (("sliding_window", sliding_window), ("logits_soft_cap", logits_soft_cap))
            if value is not None}
        self.num_kv_heads = num_kv_heads or num_heads
        assert self.num_heads % self.num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.layer_idx = layer_idx  # global layer index: the runner binds kv_cache by it
        self.layer_name = kv_layer_name(layer_idx)  # what a KV connector calls this layer's cache
        self.kv_cache = torch.empty(0)  # [2, num_blocks, block_size, num_kv_heads, head_size] once bound

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, num_heads*head_size], key/value [T, num_kv_heads*head_size] -> [T, num_heads*head_size].
        `sinks` [num_heads]: GPT-OSS's per-head logit in each softmax's denominator (a weight its model owns)."""
        q = query.unflatten(-1, (self.num_heads, self.head_size))
        k = key.unflatten(-1, (self.num_kv_heads, self.head_size))
        v = value.unflatten(-1, (self.num_kv_heads, self.head_size))
        context = get_forward_context()
        metadata = context.attn_metadata
        if self.sliding_window is not None and context.sliding_attn_metadata is not None:
            metadata = context.sliding_attn_metadata  # its group's block table and slots (kv_cache_groups.py)
        if metadata is None:
            return self._forward_without_cache(q, k, v, sinks)
        assert isinstance(metadata, AttentionMetadata)
        assert self.kv_cache.numel() > 0, f"layer {self.layer_idx} has no KV cache bound"
        features = self.features if sinks is None else {**self.features, "sinks": sinks}
        connector = context.kv_connector
        if connector is None:
            return metadata.backend.forward(q, k, v, self.kv_cache, metadata, self.scale, **features)
        connector.wait_for_layer_load(self.layer_name)
        output = metadata.backend.forward(q, k, v, self.kv_cache, metadata, self.scale, **features)
        connector.save_kv_layer(self.layer_name, self.kv_cache, metadata)
        return output

    def _forward_without_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               sinks: torch.Tensor | None) -> torch.Tensor:
        """Dummy and profile runs: the whole batch as one causal sequence, the cache untouched (a soft-capped layer
        scores by hand here too, so that the profile sees its memory)."""
        mask = None
        if self.sliding_window is not None:
            pos = torch.arange(q.shape[0], device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.sliding_window)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, T, D]
        out = attend(q, k, v, mask, mask is None, self.scale, self.logits_soft_cap,
                     None if sinks is None else sinks.view(1, -1, 1, 1))
        return out[0].transpose(0, 1).flatten(1)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size}" + "".join(f", {name}={value}" for name, value in self.features.items()))
