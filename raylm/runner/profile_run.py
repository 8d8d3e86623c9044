"""The profile run: the largest step the engine can take, on the real attention backend and the full sampler, so
that the memory the KV cache may take is measured on what really runs.

It runs before the KV cache exists. Its batch is the heaviest one the scheduler can build for attention: requests of
the longest query a step allows (up to max_model_len tokens), each at the end of a max_model_len context; every
layer and request reads one zeroed scratch cache (the blocks of one request of one layer) and writes nothing (slot
-1). Then the sampler takes a full batch of logits on its heaviest path: every row random with top-k and top-p (a
sort over the vocabulary), penalties, and vLLM's default maximum of logprobs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from raylm.common.outputs import IntermediateTensors
from raylm.runner.attention.backend import AttentionBackend
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.input_buffers import InputBuffers
from raylm.runner.layers.mla_attention import kv_cache_shape
from raylm.runner.sampler import Sampler
from raylm.runner.sampling_metadata import SamplingMetadata

if TYPE_CHECKING:
    from raylm.runner.layers.attention import Attention
    from raylm.runner.models.llama import LlamaForCausalLM

# vLLM's default max_logprobs: the logprobs a request asks for at most, in the sampler's profile.
PROFILE_NUM_LOGPROBS = 20

# The runner's forward: (num_tokens, num_reqs, uniform_decode, attention metadata, received tensors) -> output.
Forward = Callable[[int, int, bool, CommonAttentionMetadata | None, IntermediateTensors | None],
                   torch.Tensor | IntermediateTensors]


class ProfileRun:
    def __init__(self, buffers: InputBuffers, attn_backend: AttentionBackend, sampler: Sampler, dtype: torch.dtype,
                 max_model_len: int) -> None:
        self.buffers, self.attn_backend, self.sampler = buffers, attn_backend, sampler
        self.dtype, self.max_model_len = dtype, max_model_len

    @torch.inference_mode()
    def run(self, model: LlamaForCausalLM, layers: list[Attention], forward: Forward,
            is_last_stage: bool) -> int:
        """The max-size forward (through the runner's `forward`, the one caller of the model) and sampler step;
        returns the bytes of the scratch KV cache it held (the caller's peak includes them, an activation peak must
        not)."""
        assert all(layer.kv_cache.numel() == 0 for layer in layers), "the profile run comes before the KV cache"
        buffers = self.buffers
        common = buffers.prepare_profile(buffers.max_num_tokens, self.max_model_len)
        scratch: dict[tuple[int, ...], torch.Tensor] = {}
        for layer in layers:  # layers alike share one scratch: the profile reads zeros and writes nothing
            shape = kv_cache_shape(layer, self.attn_backend, buffers.max_blocks_per_req, buffers.block_size)
            layer.kv_cache = scratch.setdefault(shape, torch.zeros(shape, dtype=self.dtype, device=buffers.device))
        try:
            hidden = forward(common.num_actual_tokens, common.num_reqs, False, common, None)
        finally:
            for layer in layers:
                layer.kv_cache = torch.empty(0)
        if is_last_stage:
            assert isinstance(hidden, torch.Tensor)
            num_rows = buffers.max_num_reqs
            rows = torch.arange(num_rows, device=hidden.device) % hidden.shape[0]
            logits = model.compute_logits(hidden[rows]).float()
            self.sampler(logits, profile_sampling_metadata(num_rows, logits.shape[-1], buffers.device))
        return sum(t.numel() * t.element_size() for t in scratch.values())


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
