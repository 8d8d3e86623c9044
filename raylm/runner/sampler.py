"""Logits -> next tokens: logits processors, greedy or seeded random sampling, and logprobs of the raw logits.

Random rows use the Gumbel-max trick with counter-based noise: the noise of (seed, output position, token) is a hash
of the three, so a seeded request repeats exactly and its tokens never depend on what else is in the batch.

Nothing here reads a device value on the host (runner/host_sync.py): on CUDA a sampler step queues its kernels and
returns. The CPU keeps two faster paths that do read values: numpy's argmax, and noise for the random rows only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch
from torch import nn

from raylm.common.outputs import LogprobsLists
from raylm.common.sampling_params import _GREEDY_EPS
from raylm.runner.host_sync import host_reads_are_free, to_host
from raylm.runner.penalties import apply_logits_processors
from raylm.runner.sampling_metadata import SamplingMetadata

_MASK32 = 0xFFFFFFFF
# lowbias32 (Chris Wellons' hash-prospector). The second multiplier is stored mod 2**32 as a negative number, so that
# x * m stays within int64 for every 32-bit x: no overflow is relied upon and the low 32 bits are the same.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
# Uniforms keep 23 hash bits: (bits + 0.5) * 2**-23 is exact in float32, so u is never 0 or 1.
_UNIFORM_BITS = 23


@dataclass
class LogprobsTensors:
    """Column 0 is the sampled token, then the top k (k = max_num_logprobs) by logprob, for every row. Logprobs are
    log_softmax of the raw logits, before any processing (vLLM's "raw_logprobs")."""

    token_ids: torch.Tensor  # [B, k + 1] int64
    logprobs: torch.Tensor  # [B, k + 1] float32
    ranks: torch.Tensor  # [B] int64: 1 + the number of tokens with a strictly higher logprob than the sampled one

    @classmethod
    def from_logprobs(cls, logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
        assert 0 <= num_logprobs <= logprobs.shape[-1]
        sampled_logprobs = logprobs.gather(1, sampled[:, None])
        ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
        top_logprobs, top_token_ids = logprobs.topk(num_logprobs, dim=-1)
        return cls(torch.cat([sampled[:, None], top_token_ids], dim=1),
                   torch.cat([sampled_logprobs, top_logprobs], dim=1), ranks)

    def tolists(self, num_logprobs_per_row: Sequence[int | None]) -> list[LogprobsLists | None]:
        """One single-position LogprobsLists per row, cut to that row's n + 1 entries; None where n is None."""
        assert len(num_logprobs_per_row) == self.token_ids.shape[0]
        token_ids, logprobs, ranks = (t.tolist() for t in to_host(self.token_ids, self.logprobs, self.ranks))
        return [None if n is None else LogprobsLists([token_ids[row][: n + 1]], [logprobs[row][: n + 1]], [ranks[row]])
                for row, n in enumerate(num_logprobs_per_row)]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs_tensors: LogprobsTensors | None  # None: no row wants logprobs


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Samples one token per row of logits [B, V] float32, which it modifies in place."""
        assert logits.dim() == 2 and logits.dtype == torch.float32, "logits must be [num_rows, vocab] float32"
        assert logits.shape[0] == metadata.temperature.shape[0], "one metadata row per logits row"
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.log_softmax(dim=-1)
        apply_logits_processors(logits, metadata)
        sampled = self.sample(logits, metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None)
        assert metadata.max_num_logprobs is not None
        return SamplerOutput(sampled, LogprobsTensors.from_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs))

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax of the processed logits; random rows are sampled after temperature, top-k,
        top-p and min-p. On CPU only the random rows are copied and get noise; on a device, choosing those rows
        would read their count back, so a mixed batch draws for every row and keeps the greedy rows' argmax."""
        greedy = None if metadata.all_random else argmax_rows(logits)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        temperature = metadata.temperature
        is_random = None if metadata.all_random else temperature >= _GREEDY_EPS
        rows = None
        if is_random is not None and host_reads_are_free(logits):
            rows = torch.nonzero(is_random).squeeze(1)
        elif is_random is not None:
            temperature = temperature.where(is_random, 1.0)  # greedy rows' draws are discarded: avoid 0 / 0
        random_logits = _take_rows(logits, rows)
        random_logits.div_(_take_rows(temperature, rows)[:, None])
        apply_top_k_top_p_min_p(random_logits, _take_rows(metadata.top_k, rows), _take_rows(metadata.top_p, rows),
                                _take_rows(metadata.min_p, rows), metadata.max_top_k)
        sampled = gumbel_max_sample(random_logits, _take_rows(metadata.seeds, rows),
                                    _take_rows(metadata.output_positions, rows))
        if is_random is None:
            return sampled
        assert greedy is not None
        if rows is None:
            return torch.where(is_random, sampled, greedy)
        return greedy.index_copy_(0, rows, sampled)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] float32 -> [R] int64, the first index of each row's maximum. On CPU numpy's vectorised argmax runs 5-7x
    faster than torch's (48 x 4096: 19 vs 148 us)."""
    if host_reads_are_free(logits):
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


@overload
def _take_rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor: ...
@overload
def _take_rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None: ...
def _take_rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """The random rows of a per-row tensor: all of it when rows is None (every row is random)."""
    return t if t is None or rows is None else t[rows]


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                            min_p: torch.Tensor | None, max_top_k: int | None = None) -> torch.Tensor:
    """Sets to -inf, in place, what top-k, then top-p (on the top-k survivors), then min-p filter out; None skips a
    filter. Each filter is a per-row logit threshold (ties at it are kept), so only one masking pass is needed.
    `max_top_k`: the largest top-k of the rows as the host knows it (None: read from `top_k` on CPU; on a device,
    where that read would wait, every row is sorted in full)."""
    vocab_size = logits.shape[-1]
    thresholds: list[torch.Tensor] = []
    max_k = vocab_size
    if top_k is not None:
        top_k = top_k.masked_fill((top_k <= 0) | (top_k > vocab_size), vocab_size)  # k = vocab_size: off
        if max_top_k is not None:
            max_k = min(max_top_k, vocab_size)
        elif host_reads_are_free(top_k):
            max_k = int(top_k.max())
    if top_p is not None:
        thresholds.append(_top_p_threshold(logits, top_k, top_p, max_k))
    elif top_k is not None:
        thresholds.append(_top_k_threshold(logits, top_k, max_k))
    if min_p is not None:
        # p_i < min_p * p_max  <=>  logit_i < max_logit + log(min_p); log(0) = -inf keeps everything.
        thresholds.append(logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None])
    if thresholds:
        threshold = thresholds[0]
        for other in thresholds[1:]:
            threshold = torch.maximum(threshold, other)
        logits.masked_fill_(logits < threshold, float("-inf"))
    return logits


def _top_k_threshold(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """[R, 1]: the k-th largest logit, -inf where top-k is off; max_k >= every row's k."""
    off = top_k >= logits.shape[-1]
    top_k = top_k.masked_fill(off, 1)
    top_values = logits.topk(max_k, dim=-1).values
    return top_values.gather(1, (top_k - 1)[:, None]).masked_fill_(off[:, None], float("-inf"))


def _top_p_threshold(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor,
                     max_k: int) -> torch.Tensor:
    """[R, 1]: the smallest logit of the smallest set of most likely top-k survivors whose mass is >= p; max_k >=
    every row's k (the vocabulary size without top-k)."""
    vocab_size = logits.shape[-1]
    # Only the largest max_k logits matter: when every row has a top-k that is a partial sort, not a full one.
    if max_k < vocab_size:
        sorted_logits = logits.topk(max_k, dim=-1).values
    else:
        sorted_logits = logits.sort(dim=-1, descending=True).values
    probs = (sorted_logits - sorted_logits[:, :1]).exp_()
    if top_k is not None:
        probs.masked_fill_(torch.arange(max_k, device=logits.device) >= top_k[:, None], 0.0)
    # Unnormalised and summed in order from the top, so a row gets bit-identical sums in either sort: the result does
    # not depend on the other rows of the batch.
    cumulative = probs.cumsum_(dim=-1)
    num_kept = (cumulative < top_p[:, None] * cumulative[:, -1:]).sum(dim=-1, keepdim=True) + 1
    return sorted_logits.gather(1, num_kept - 1)


def gumbel_max_sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """argmax(logits + G) with G = -log(-log(u)) ~ Gumbel(0, 1) is a draw from softmax(logits). Consumes logits."""
    log_exponential = random_uniform(seeds, positions, logits.shape[-1]).log_().neg_().log_()
    return argmax_rows(logits.sub_(log_exponential))


def random_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab_size] float32 in (0, 1); entry (r, t) is a pure function of (seeds[r], positions[r], t)."""
    assert seeds.dtype == torch.int64 and positions.dtype == torch.int64
    key = lowbias32_(seeds & _MASK32)
    key = lowbias32_(key.bitwise_xor_((seeds >> 32) & _MASK32))
    key = lowbias32_(key.bitwise_xor_(positions & _MASK32))
    bits = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device).bitwise_xor(key[:, None])
    bits = lowbias32_(bits).bitwise_right_shift_(32 - _UNIFORM_BITS)
    return bits.to(torch.float32).add_(0.5).mul_(2.0**-_UNIFORM_BITS)


def lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash, in place, of int64 values in [0, 2**32)."""
    assert x.dtype == torch.int64
    scratch = torch.empty_like(x)
    _xorshift_(x, 16, scratch).mul_(_MUL1).bitwise_and_(_MASK32)
    _xorshift_(x, 15, scratch).mul_(_MUL2).bitwise_and_(_MASK32)
    return _xorshift_(x, 16, scratch)


def _xorshift_(x: torch.Tensor, shift: int, scratch: torch.Tensor) -> torch.Tensor:
    return x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=scratch))
