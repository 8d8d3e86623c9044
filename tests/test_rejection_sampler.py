"""The rejection sampler on a small vocabulary, against the target distribution it must reproduce.

Statistical checks (fixed seeds, so they are deterministic): N = 60,000 independent requests (one seed each) verify
two drafts each; the first token they emit must follow the target's distribution at the first position, and the
token after an accepted first draft the target's at the second, whatever the drafts' distribution (one-hot, as ngram
drafts; or sampled from a draft model's q). Tolerance: every probability within 0.012 (about 5 standard errors of a
frequency from 60,000 draws: sqrt(0.25 / 60000) = 0.002; the conditional one from fewer, see below).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from raylm.runner.sampler import Sampler, apply_top_k_top_p_min_p
from raylm.runner.sampling_metadata import SamplingMetadata
from raylm.runner.spec_decode.metadata import build_spec_decode_metadata
from raylm.runner.spec_decode.rejection_sampler import RejectionSampler

VOCAB = 8
NUM_REQUESTS = 60_000
NUM_DRAFTS = 2
TOLERANCE = 0.012


def metadata(temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
             top_k: torch.Tensor | None = None) -> SamplingMetadata:
    rows = temperature.shape[0]
    greedy = temperature < 1e-5
    return SamplingMetadata(
        temperature=temperature, all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()), top_k=top_k,
        top_p=None, min_p=None, seeds=seeds, output_positions=positions, max_num_logprobs=None, no_penalties=True,
        presence_penalties=torch.zeros(rows), frequency_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows))


def target_distributions(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    scaled = logits / temperature
    apply_top_k_top_p_min_p(scaled, torch.full((scaled.shape[0],), top_k), None, None)
    return scaled.softmax(dim=-1)


def run_sampler(position_logits: torch.Tensor, drafts: np.ndarray, draft_probs: torch.Tensor | None,
                temperature: float, top_k: int = 0, seed_offset: int = 0) -> list[list[int]]:
    """position_logits [NUM_DRAFTS + 1, VOCAB]: the target's logits at each draft position and the bonus, the same
    for every request; drafts [NUM_REQUESTS, NUM_DRAFTS]."""
    rows_per_request = NUM_DRAFTS + 1
    logits = position_logits.repeat(NUM_REQUESTS, 1)
    num_rows = logits.shape[0]
    seeds = torch.arange(NUM_REQUESTS, dtype=torch.int64).repeat_interleave(rows_per_request) + seed_offset
    positions = torch.arange(rows_per_request, dtype=torch.int64).repeat(NUM_REQUESTS) + 7
    spec = build_spec_decode_metadata(np.full(NUM_REQUESTS, NUM_DRAFTS),
                                      np.arange(NUM_REQUESTS) * rows_per_request + NUM_DRAFTS, drafts.ravel(),
                                      torch.device("cpu"))
    top_k_rows = torch.full((num_rows,), top_k) if top_k else None
    return RejectionSampler()(logits, metadata(torch.full((num_rows,), temperature), seeds, positions, top_k_rows),
                              spec, draft_probs).token_ids


def frequencies(tokens: list[int]) -> np.ndarray:
    return np.bincount(np.asarray(tokens), minlength=VOCAB) / len(tokens)


@pytest.fixture(scope="module")
def position_logits() -> torch.Tensor:
    return torch.randn(NUM_DRAFTS + 1, VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5


@pytest.mark.parametrize(("drafting", "temperature", "top_k"), [
    ("one_hot", 1.0, 0), ("one_hot", 0.7, 5), ("model", 1.0, 0), ("model", 0.8, 4)])
def test_output_follows_the_target_distribution(position_logits: torch.Tensor, drafting: str, temperature: float,
                                                top_k: int) -> None:
    rng = np.random.default_rng(0)
    p = target_distributions(position_logits, temperature, top_k)
    if drafting == "one_hot":  # ngram: a fixed guess per position, here the second most likely and a poor one
        drafts = np.tile([int(p[0].argsort()[-2]), int(p[1].argsort()[0])], (NUM_REQUESTS, 1))
        draft_probs = None
    else:  # a draft model: its own distribution q, drafts drawn from it (independently of the sampler's noise)
        q = torch.softmax(torch.randn(NUM_DRAFTS, VOCAB, generator=torch.Generator().manual_seed(5)), dim=-1)
        drafts = np.stack([rng.choice(VOCAB, size=NUM_REQUESTS, p=q[j].double().numpy() / q[j].double().sum().item())
                           for j in range(NUM_DRAFTS)], axis=1)
        draft_probs = q.repeat(NUM_REQUESTS, 1)
    outputs = run_sampler(position_logits.clone(), drafts, draft_probs, temperature, top_k)
    assert all(1 <= len(tokens) <= NUM_DRAFTS + 1 for tokens in outputs)
    first = frequencies([tokens[0] for tokens in outputs])
    assert np.abs(first - p[0].numpy()).max() < TOLERANCE, (first, p[0])
    # Given the first draft accepted, the next token follows the target at position 2. Fewer draws back this one:
    # the tolerance holds only with enough of them (at least 6,000 here: ~4 standard errors).
    after_first = [tokens[1] for tokens in outputs if len(tokens) >= 2]
    assert len(after_first) > 6_000
    assert np.abs(frequencies(after_first) - p[1].numpy()).max() < TOLERANCE + 0.01
    # Seeded: the same seeds give the same tokens.
    assert run_sampler(position_logits.clone(), drafts, draft_probs, temperature, top_k)[:500] == outputs[:500]


def test_one_hot_drafts_give_the_tokens_plain_sampling_gives(position_logits: torch.Tensor) -> None:
    """With one-hot drafts the verification reuses plain sampling's draw at each output position, so a seeded request
    gets the same tokens with speculation as without."""
    drafts = np.tile([int(position_logits[0].argmax()), int(position_logits[1].argmax())], (NUM_REQUESTS, 1))
    outputs = run_sampler(position_logits.clone(), drafts, None, 1.0)[:2000]
    seeds = torch.arange(2000, dtype=torch.int64)
    for position in range(NUM_DRAFTS + 1):
        plain = Sampler.sample(position_logits[position].repeat(2000, 1),
                               metadata(torch.ones(2000), seeds, torch.full((2000,), 7 + position))).tolist()
        assert [tokens[position] for tokens in outputs if len(tokens) > position] == \
            [token for token, tokens in zip(plain, outputs) if len(tokens) > position]


def test_greedy_accepts_while_drafts_equal_the_argmax(position_logits: torch.Tensor) -> None:
    best = [int(position_logits[j].argmax()) for j in range(NUM_DRAFTS + 1)]
    cases = {(best[0], best[1]): best, (best[0], (best[1] + 1) % VOCAB): best[:2], ((best[0] + 1) % VOCAB, best[1]):
             best[:1]}
    for drafts, expected in cases.items():
        spec = build_spec_decode_metadata(np.array([NUM_DRAFTS]), np.array([NUM_DRAFTS]), np.array(drafts),
                                          torch.device("cpu"))
        out = RejectionSampler()(position_logits.clone(), metadata(torch.zeros(3), torch.zeros(3, dtype=torch.int64),
                                                                   torch.arange(3)), spec)
        assert out.token_ids == [expected]
