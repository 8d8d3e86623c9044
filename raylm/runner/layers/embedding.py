"""Vocabulary-parallel token embedding and LM head: each TP rank holds a contiguous slice of the (padded)
vocabulary."""
from __future__ import annotations

import torch
from torch import nn

from raylm.runner.layers.cpu_gemm import CpuGemmMixin
from raylm.runner.layers.linear import get_quant_method, set_weight_loader
from raylm.runner.parallel_state import get_tp_group

DEFAULT_VOCAB_PADDING_SIZE = 64


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    weight: torch.Tensor  # [vocab rows of this rank, hidden], made by the quant method's create_weights

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_embeddings = num_embeddings  # the real vocabulary; rows past it are zero padding
        self.num_embeddings_padded = _round_up(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.embedding_dim = embedding_dim
        self.quant_method = get_quant_method(self)
        self.quant_method.create_weights(self, embedding_dim, self.num_embeddings_per_partition, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        assert shard_id is None
        expected = (self.num_embeddings, *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded_weight.shape)}, expected {expected}")
        rows = max(0, min(self.vocab_end_index, self.num_embeddings) - self.vocab_start_index)
        param.data[:rows].copy_(loaded_weight[self.vocab_start_index:self.vocab_start_index + rows])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_ids)
        in_shard = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * in_shard
        embeddings = self.quant_method.embedding(self, local_ids)
        embeddings = embeddings * in_shard.unsqueeze(-1).to(embeddings.dtype)
        return get_tp_group().all_reduce(embeddings)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, per_partition={self.num_embeddings_per_partition}, tp={self.tp_size}"


class ParallelLMHead(CpuGemmMixin, VocabParallelEmbedding):
    """Logits over the vocabulary; every TP rank gets the full logits (all-gather of the vocab shards), so every
    rank can sample the same tokens."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_size)
        self.bias = None
        if bias:
            self.bias = set_weight_loader(
                nn.Parameter(torch.empty(self.num_embeddings_per_partition), requires_grad=False),
                self.weight_loader)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        assert embed_tokens.weight.shape == self.weight.shape, "tied embeddings must be sharded alike"
        self.weight = embed_tokens.weight
        self.quant_method = embed_tokens.quant_method  # one weight, one way to read it

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def kernel_name(self) -> str:
        return self.quant_method.kernel_name(self)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits."""
        logits = self.quant_method.apply(self, hidden_states, self.bias)
        logits = get_tp_group().all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings]
