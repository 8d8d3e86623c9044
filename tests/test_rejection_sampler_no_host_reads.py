"""The rejection sampler's device part reads nothing back to the host, like the sampler (tests/host_reads.py):
compiled with fullgraph=True and a backend that fails on any data-dependent value, it verifies greedy, random,
one-hot and draft-model drafts (uneven counts, a request without drafts) with logprobs exactly as the eager path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from raylm.common.sampling_params import SamplingParams
from raylm.runner.spec_decode.metadata import build_spec_decode_metadata
from raylm.runner.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, MatrixLayout, RejectionSampler
from tests.host_reads import compile_without_host_reads
from tests.test_sampler import make_metadata

VOCAB = 64
G = dict(temperature=0.0, seed=3)
R = dict(temperature=0.9, seed=7)
CASES = {  # (per request: params, number of drafts), whether a draft model drew the random requests' drafts
    "greedy": ([(SamplingParams(**G), 2), (SamplingParams(**G), 0), (SamplingParams(**G), 3)], False),
    "random_one_hot": ([(SamplingParams(**R, top_k=5), 3), (SamplingParams(temperature=1.2, seed=1), 1)], False),
    "mixed_draft_model": ([(SamplingParams(**G), 2), (SamplingParams(**R), 3), (SamplingParams(**R, top_p=0.8), 1)],
                          True),
    "logprobs": ([(SamplingParams(**G, logprobs=2), 1), (SamplingParams(**R, min_p=0.05, logprobs=0), 2)], True),
}


@pytest.mark.parametrize("case", CASES)
def test_verify_compiles_without_host_reads(case: str) -> None:
    requests, from_draft_model = CASES[case]
    counts = np.array([n for _, n in requests])
    row_params = [p for p, n in requests for _ in range(n + 1)]
    positions = [4 + j for _, n in requests for j in range(n + 1)]
    metadata = make_metadata(row_params, VOCAB, positions=positions)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(len(row_params), VOCAB, generator=gen) * 2
    # Drafts: the row's argmax (accepted when greedy) or a random token, so both outcomes occur.
    is_draft = np.concatenate([np.arange(n + 1) < n for n in counts])
    argmax = logits.argmax(dim=-1).numpy()[is_draft]
    drafts = np.where(np.arange(len(argmax)) % 3 == 2, (argmax + 1) % VOCAB, argmax)
    spec = build_spec_decode_metadata(counts, np.cumsum(counts + 1) - 1, drafts, torch.device("cpu"))
    draft_probs = None
    if from_draft_model:  # q for the random requests' drafts, NaN (one-hot) for the greedy ones'
        draft_probs = torch.softmax(torch.randn(len(drafts), VOCAB, generator=gen), dim=-1)
        greedy_drafts = np.repeat([p.temperature == 0 for p, _ in requests], counts)
        draft_probs[torch.from_numpy(greedy_drafts)] = float("nan")
    layout = MatrixLayout(spec, torch.device("cpu"))

    compiled, backend = compile_without_host_reads(RejectionSampler.verify)
    got, got_logprobs = compiled(logits.clone(), metadata, spec.draft_token_ids, layout, draft_probs)
    assert backend.num_graphs >= 1  # the compiled path ran, not an eager fallback
    want, want_logprobs = RejectionSampler.verify(logits.clone(), metadata, spec.draft_token_ids, layout, draft_probs)
    assert torch.equal(got, want)
    assert (got_logprobs is None) == (want_logprobs is None)
    if want_logprobs is not None:
        assert got_logprobs is not None
        for field in ("token_ids", "logprobs", "ranks"):
            assert torch.equal(getattr(got_logprobs, field), getattr(want_logprobs, field))

    # The matrix: accepted drafts, one more token, placeholders; greedy requests accept exactly the argmax drafts.
    assert got.shape == (len(requests), int(counts.max()) + 1)
    emitted = (got != PLACEHOLDER_TOKEN_ID).sum(dim=1).numpy()
    assert ((emitted >= 1) & (emitted <= counts + 1)).all()
    starts = np.cumsum(counts) - counts
    for i, (params, n) in enumerate(requests):
        row = got[i, : emitted[i]].tolist()
        assert row[:-1] == drafts[starts[i] : starts[i] + emitted[i] - 1].tolist()
        if params.temperature == 0:
            matches = drafts[starts[i] : starts[i] + n] == argmax[starts[i] : starts[i] + n]
            assert emitted[i] - 1 == int(np.cumprod(matches).sum())
