"""Llama (and the base of the Qwen2/Qwen3 models): tensor-parallel layers, pipeline-parallel layer list."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from raylm.common.outputs import IntermediateTensors
from raylm.runner.layers.activation import SiluAndMul
from raylm.runner.layers.attention import Attention
from raylm.runner.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from raylm.runner.layers.layernorm import RMSNorm
from raylm.runner.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    WeightLoader,
    default_weight_loader,
)
from raylm.runner.layers.rotary_embedding import get_rope
from raylm.runner.models.utils import (
    PPMissingLayer,
    get_head_dim,
    get_rope_config,
    make_empty_intermediate_tensors,
    make_layers,
    pp_missing_prefixes,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from raylm.runner.layers.quantization.ggml_blocks import QuantizedTensor



class FusedDecoderLayers(Protocol):
    """The decoder layers run as one call where a step allows it (cpu_layer_stack.CpuLayerStack): declared here so
    that the model depends on what it calls, and the kernel stack on the model, not both ways."""

    def runs(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> bool: ...

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


# The part of a packed parameter a checkpoint tensor fills: "q"/"k"/"v", an output index, or (expert id, "w1"/"w2"/"w3")
ShardId = str | int | tuple[int, str] | None


class LlamaMLP(nn.Module):
    # On CPU a long batch runs in chunks of this many tokens, so that the [tokens, 2 * intermediate] activation
    # stays in cache between gate_up_proj, the activation and down_proj (gate_up_proj of the 107M benchmark
    # model: ~370 GFLOP/s on 2048 tokens, ~450 on 512-token chunks).
    cpu_chunk_tokens = 512

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported activation {hidden_act!r}; only 'silu' is supported")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Not under LoRA: its per-token adapter mask covers the whole batch, not a chunk of it.
        if x.device.type == "cpu" and x.shape[0] > self.cpu_chunk_tokens and self.gate_up_proj.lora is None:
            return torch.cat([self._forward(chunk) for chunk in x.split(self.cpu_chunk_tokens)])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__()
        self.head_dim = get_head_dim(config)
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_num_heads, total_num_kv_heads,
                                          bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        rope_theta, rope_scaling = get_rope_config(config)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, rope_theta, rope_scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_idx)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for models that normalise q and k before rotary (Qwen3); Llama does not."""
        return q, k

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, *self.norm_qk(q, k))
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.make_attention(config, layer_idx)
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_attention(self, config: PretrainedConfig, layer_idx: int) -> LlamaAttention:
        bias = getattr(config, "attention_bias", False)
        return LlamaAttention(config, layer_idx, qkv_bias=bias, o_bias=bias)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        """Hook for models whose feed-forward differs (MoE layers); `layer_idx` picks it per layer."""
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                        bias=getattr(config, "mlp_bias", False))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    supports_layer_types: ClassVar[bool] = False  # whether its layers read config.layer_types (sliding windows)

    def __init__(self, config: PretrainedConfig, layer_type: type[LlamaDecoderLayer], pp_rank: int = 0,
                 pp_size: int = 1, partition: list[int] | None = None) -> None:
        super().__init__()
        if getattr(config, "use_sliding_window", False) or not self.supports_layer_types and any(
                t != "full_attention" for t in getattr(config, "layer_types", None) or []):
            raise ValueError("sliding-window attention is not supported")
        self.is_first_rank, self.is_last_rank = pp_rank == 0, pp_rank == pp_size - 1
        tied = getattr(config, "tie_word_embeddings", False)
        # With tied embeddings the last stage needs the embedding weight for its LM head.
        self.embed_tokens: nn.Module = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                                        if self.is_first_rank or (tied and self.is_last_rank) else PPMissingLayer())
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: layer_type(config, i), pp_rank, pp_size, partition)
        self.norm: nn.Module = (RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.is_last_rank
                                else PPMissingLayer())
        self.layer_stack: FusedDecoderLayers | None = None  # set after loading where the layers can run as one call

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if self.is_first_rank:
            hidden_states, residual = self.embed_input_ids(input_ids), None
        else:
            assert intermediate_tensors is not None, "a non-first pipeline stage needs intermediate_tensors"
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        if self.layer_stack is not None and self.layer_stack.runs(positions, hidden_states):
            hidden_states, residual = self.layer_stack.forward(positions, hidden_states, residual)
        else:
            for layer in islice(self.layers, self.start_layer, self.end_layer):
                hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.is_last_rank:
            assert residual is not None  # every stage owns a layer (get_pp_indices), and a layer sets it
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hook for models that scale their embeddings (Gemma)."""
        return self.embed_tokens(input_ids)


class LlamaForCausalLM(nn.Module):
    model_type: ClassVar[type[LlamaModel]] = LlamaModel
    layer_type: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # (parameter name part, checkpoint name part, shard id)
    stacked_params_mapping: ClassVar[list[tuple[str, str, ShardId]]] = [
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    ]

    def __init__(self, config: PretrainedConfig, pp_rank: int = 0, pp_size: int = 1,
                 partition: list[int] | None = None) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = type(self).model_type(config, type(self).layer_type, pp_rank, pp_size, partition)
        self.lm_head: nn.Module = PPMissingLayer()
        if self.model.is_last_rank:
            lm_head = self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings:
                assert isinstance(self.model.embed_tokens, VocabParallelEmbedding)  # the last stage keeps it, tied
                lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """Last stage: hidden_states [T, hidden]; other stages: IntermediateTensors for the next one."""
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] (full vocabulary on every TP rank)."""
        assert self.model.is_last_rank, "only the last pipeline stage computes logits"
        return self.lm_head(hidden_states)

    def make_empty_intermediate_tensors(self, num_tokens: int, dtype: torch.dtype,
                                        device: torch.device | str) -> IntermediateTensors:
        return make_empty_intermediate_tensors(num_tokens, self.config.hidden_size, dtype, device)

    def get_expert_mapping(self) -> list[tuple[str, str, ShardId]]:
        """(parameter name part, checkpoint name part, shard id) of every expert weight: empty here, MoE models
        override it. Tried before stacked_params_mapping, whose `.gate_proj.` also matches an expert's name."""
        return []

    def _expected_shards(self, param_name: str, mapping: list[tuple[str, str, ShardId]]) -> set[ShardId]:
        return {shard for part, _, shard in mapping if part in param_name} or {None}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        """Load full checkpoint tensors (each TP rank keeps its shard); weights of modules another pipeline
        stage owns are skipped. Returns the parameter names loaded completely (every shard of a packed one)."""
        params = dict(self.named_parameters())
        missing_prefixes = pp_missing_prefixes(self)
        mapping = [*self.get_expert_mapping(), *self.stacked_params_mapping]
        loaded: dict[str, set[ShardId]] = defaultdict(set)
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name or name.startswith(missing_prefixes):
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # the same tensor as the embedding
            shard_id: ShardId = None
            for param_part, weight_part, shard in mapping:
                if weight_part in name:
                    name, shard_id = name.replace(weight_part, param_part), shard
                    break
            if name not in params:
                raise ValueError(f"checkpoint weight {name!r} matches no parameter of {type(self).__name__}")
            param = params[name]
            # A packed layer's loader takes packed blocks (QuantizedTensor); the default one, float tensors.
            weight_loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, loaded_weight, shard_id)
            loaded[name].add(shard_id)
        return {name for name, shards in loaded.items() if shards == self._expected_shards(name, mapping)}
