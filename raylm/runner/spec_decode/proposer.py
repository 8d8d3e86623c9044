"""The proposer interface: after a step's tokens are known, propose each request's drafts for its next step.

ngram (prompt lookup) and a draft model implement it; an EAGLE-style head fits the same way: it reads the target's
hidden states of the step (`ProposeInputs.hidden_states`), may share the target's embeddings and LM head
(`load_model` gets the target), and names its attention layers so that the worker gives them KV cache beside the
target's (same blocks, same block table).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from raylm.runner.input_batch import InputBatch
from raylm.runner.layers.attention import Attention
from raylm.runner.sampling_metadata import SamplingMetadata


@dataclass
class ProposeInputs:
    """One step as a proposer sees it, once the accepted tokens are appended to the batch."""

    batch: InputBatch
    sampling_rows: np.ndarray  # rows that got tokens this step, the ones to propose for
    max_num_drafts: np.ndarray  # per sampling row: at most this many drafts (k, capped by max_model_len)
    # Per batch row [num_reqs]: the first position this step computed, and one past the last that holds an accepted
    # token's KV now (for a sampling row: its new last token, whose KV no model has computed yet, is not included).
    step_start: np.ndarray
    step_end: np.ndarray
    sampling_metadata: SamplingMetadata  # per sampling row: temperature, seeds, filters
    hidden_states: torch.Tensor | None = None  # the target's last hidden states of the step's packed tokens


@dataclass
class Proposals:
    token_ids: list[list[int]]  # per sampling row, at most max_num_drafts[i] each
    # Per sampling row, the distributions the drafts were sampled from ([s, vocab] float32), for the rejection
    # sampler's accept/resample rule; None for a row whose drafts are one-hot (ngram, greedy drafting).
    probs: list[torch.Tensor | None] | None = None


class Proposer(ABC):
    def load_model(self, target_model: torch.nn.Module) -> None:  # noqa: B027 (optional: ngram has no model)
        """Build whatever the proposer runs (after the target is loaded, which it may share weights with)."""

    def attention_layers(self) -> list[Attention]:
        """The proposer's attention layers: they get KV cache tensors of the target's block count and layout."""
        return []

    @abstractmethod
    def propose(self, inputs: ProposeInputs) -> Proposals:
        """Drafts for every sampling row of the step."""
