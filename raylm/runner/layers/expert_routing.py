"""DeepSeek's expert routing: router logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k]), for FusedMoE's
`routing`. Written as transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter compute it (vLLM's grouped_topk):

- `greedy` (V2): softmax, top-k.
- `group_limited_greedy` (V2): softmax; the experts split into n_group groups, each scored by its best expert; only
  the topk_group best groups' experts can be picked.
- `noaux_tc` (V3): sigmoid; the choice (not the weights) adds e_score_correction_bias; groups scored by the sum of
  their two best biased scores; the weights are the unbiased sigmoid scores of the chosen experts.

Then the weights are renormalised to sum to one where norm_topk_prob is set, and scaled by routed_scaling_factor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _group_mask(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """[T, E] bool: True for the experts of each token's topk_group best groups."""
    num_tokens, num_groups = group_scores.shape
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return mask[:, :, None].expand(num_tokens, num_groups, scores.shape[-1] // num_groups).reshape(scores.shape)


@dataclass
class DeepseekRouting:
    """FusedMoE's `routing` callable for one MoE layer (the correction bias is the layer's parameter, read on each
    call so that a weight reload reaches it)."""

    top_k: int
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    e_score_correction_bias: torch.Tensor | None = None  # [E], noaux_tc only

    def __post_init__(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method: {self.topk_method!r} is not supported; supported: "
                             f"{', '.join(TOPK_METHODS)}")
        if self.topk_method != "greedy" and not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group: {self.topk_group} must be between 1 and n_group ({self.n_group})")

    def __call__(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits.float()
        num_tokens, num_experts = logits.shape
        # Explicit sizes, not -1: an expert-parallel TP rank may route a slice of no tokens.
        grouped = (num_tokens, self.n_group, num_experts // self.n_group)
        if self.topk_method == "noaux_tc":
            assert self.e_score_correction_bias is not None, "noaux_tc routing needs e_score_correction_bias"
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            group_scores = choice.view(grouped).topk(2, dim=-1).values.sum(dim=-1)
            choice = choice.masked_fill(~_group_mask(choice, group_scores, self.topk_group), float("-inf"))
            topk_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
            topk_weights = scores.gather(1, topk_ids)
        else:
            scores = logits.softmax(dim=-1)
            if self.topk_method == "group_limited_greedy":
                group_scores = scores.view(grouped).max(dim=-1).values
                scores = scores.masked_fill(~_group_mask(scores, group_scores, self.topk_group), 0.0)
            topk_weights, topk_ids = scores.topk(self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_weights * self.routed_scaling_factor, topk_ids
