"""The profile run: the largest step the engine can take, on the real attention backend and the full sampler, so
that the memory the KV cache may take is measured on what really runs (a ModelRunner mixin).

It runs before the KV cache exists. Its batch is the heaviest one the scheduler can build for attention: requests of
the longest query a step allows (up to max_model_len tokens), each at the end of a max_model_len context; every
layer and request reads one zeroed scratch cache (the blocks of one request of one layer) and writes nothing (slot
-1). Then the sampler takes a full batch of logits on its heaviest path: every row random with top-k and top-p (a
sort over the vocabulary), penalties, and vLLM's default maximum of logprobs.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from raylm.runner.attention.backend import AttentionBackend
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.input_buffers import InputBuffersMixin
from raylm.runner.parallel_state import get_pp_group
from raylm.runner.sampler import Sampler
from raylm.runner.sampling_metadata import SamplingMetadata

# vLLM's default max_logprobs: the logprobs a request asks for at most, in the sampler's profile.
PROFILE_NUM_LOGPROBS = 20


class ProfileRunMixin(InputBuffersMixin):
    # Set by the ModelRunner.
    model: torch.nn.Module | None
    attn_backend: AttentionBackend
    sampler: Sampler
    dtype: torch.dtype
    max_model_len: int
    attention_layers: Callable[[], list[torch.nn.Module]]

    @torch.inference_mode()
    def profile_run(self) -> int:
        """The max-size forward and sampler step; returns the bytes of the scratch KV cache it held (the caller's
        peak includes them, an activation peak must not)."""
        assert self.model is not None, "load_model first"
        layers = self.attention_layers()
        assert all(layer.kv_cache.numel() == 0 for layer in layers), "the profile run comes before the KV cache"
        common, num_tokens = self._prepare_profile_inputs(self.max_num_tokens)
        scratch = {}
        for layer in layers:  # layers alike share one scratch: the profile reads zeros and writes nothing
            shape = self.attn_backend.get_kv_cache_shape(self.max_blocks_per_req, self.block_size,
                                                         layer.num_kv_heads, layer.head_size)
            layer.kv_cache = scratch.setdefault(shape, torch.zeros(shape, dtype=self.dtype, device=self.device))
        try:
            hidden = self._run_forward(num_tokens, common.num_reqs, False, common, None)
        finally:
            for layer in layers:
                layer.kv_cache = torch.empty(0)
        if get_pp_group().is_last_rank:
            assert isinstance(hidden, torch.Tensor)
            rows = torch.arange(self.max_num_reqs, device=hidden.device) % hidden.shape[0]
            logits = self.model.compute_logits(hidden[rows]).float()
            self.sampler(logits, profile_sampling_metadata(self.max_num_reqs, logits.shape[-1], self.device))
        return sum(t.numel() * t.element_size() for t in scratch.values())

    def _prepare_profile_inputs(self, num_tokens: int) -> tuple[CommonAttentionMetadata, int]:
        """Requests of min(num_tokens, max_model_len) query tokens (the last one shorter), at most max_num_reqs of
        them, each ending a max_model_len context over the scratch blocks 0..; slot -1 for every token."""
        query_len = min(num_tokens, self.max_model_len)
        num_reqs = min(-(-num_tokens // query_len), self.max_num_reqs)
        num_tokens = min(num_tokens, num_reqs * query_len)
        query_lens = np.full(num_reqs, query_len, dtype=np.int64)
        query_lens[-1] = num_tokens - query_len * (num_reqs - 1)
        cu_num_tokens = query_lens.cumsum()
        starts = cu_num_tokens - query_lens
        req_indices = np.repeat(np.arange(num_reqs), query_lens)
        offsets = np.arange(num_tokens) - starts[req_indices]
        self.positions.np[:num_tokens] = self.max_model_len - query_lens[req_indices] + offsets
        self.input_ids.np[:num_tokens] = 0
        self.slot_mapping.np[:num_tokens] = -1
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        self.seq_lens.np[:num_reqs] = self.max_model_len
        self.block_table[:num_reqs].copy_(torch.arange(self.max_blocks_per_req, dtype=torch.int32))
        common = self._common_metadata(num_reqs, num_tokens, self.max_blocks_per_req, query_len, self.max_model_len)
        return common, num_tokens


def profile_sampling_metadata(num_rows: int, vocab_size: int, device: torch.device) -> SamplingMetadata:
    """Every row on the sampler's heaviest path: random, top-k and top-p, all three penalties over a short history,
    logprobs."""

    def full(value: float | int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((num_rows,), value, dtype=dtype, device=device)

    history = torch.arange(num_rows * 8, device=device).remainder_(vocab_size).view(num_rows, 8)
    return SamplingMetadata(
        temperature=full(0.5, torch.float32), all_greedy=False, all_random=True,
        top_k=full(vocab_size - 1, torch.int64), top_p=full(0.99, torch.float32), min_p=full(0.01, torch.float32),
        seeds=torch.arange(num_rows, dtype=torch.int64, device=device), output_positions=full(8, torch.int64),
        max_num_logprobs=min(PROFILE_NUM_LOGPROBS, vocab_size), no_penalties=False,
        presence_penalties=full(0.5, torch.float32), frequency_penalties=full(0.5, torch.float32),
        repetition_penalties=full(1.1, torch.float32), prompt_token_ids=history, output_token_ids=history)
