"""Parallel layouts a checkpoint cannot run, refused when the engine's config is resolved: before any Ray start or
placement, naming the field, the model's number and the sizes that would work (vLLM refuses them as it builds its
config; without this a worker dies at load on an assertion, after every worker was placed).

What raylm's parallel layers need of tensor_parallel_size (raylm/runner/layers/):
- QKVParallelLinear: attention heads divisible by it; KV heads divisible by it, or (more ranks than KV heads) it a
  multiple of the KV heads, which each rank then holds one of (replicated, as vLLM does).
- MergedColumnParallel / RowParallel MLPs: intermediate_size divisible by it; a MoE's experts too
  (moe_intermediate_size, or intermediate_size for Mixtral) unless enable_expert_parallel keeps them whole, and then
  the experts divisible by the expert-parallel ranks.
- Quantized weights (int8, int4, gguf) run in 32-weight blocks along each linear's input: a row-parallel input per
  rank (heads x head_dim / tp for o_proj, intermediate / tp for down_proj) must hold whole blocks.
- The vocabulary is padded to a multiple of 64 x tp (VocabParallelEmbedding), so every vocabulary size splits.
And of pipeline_parallel_size: at least one layer per stage (pp_layer_partition, when given, sums to the layers).
"""
from __future__ import annotations

from typing import Any

from raylm.configs import quant_formats
from raylm.configs.engine_config import ParallelConfig
from raylm.configs.model_info import ModelInfo

QUANT_BLOCK = 32  # ggml's block (raylm/runner/layers/quantization/ggml_blocks.py: BLOCK_SIZE)


def check_parallel_layout(model_info: ModelInfo, parallel: ParallelConfig, quantization: str,
                          dp_lockstep: bool) -> None:
    """Raise ValueError for a layout of `parallel` that the checkpoint cannot run under `quantization`."""
    _check_pipeline(model_info, parallel)
    _check_expert_parallel(model_info, parallel, dp_lockstep)
    tp = parallel.tensor_parallel_size
    problem = tensor_parallel_problem(model_info, tp, quantization, parallel.enable_expert_parallel)
    if problem is not None:
        raise ValueError(f"tensor_parallel_size {tp}: {problem}; use "
                         f"{_sizes(tensor_parallel_sizes(model_info, quantization, parallel.enable_expert_parallel))}")


def check_draft_tensor_parallel(draft: ModelInfo, target: ModelInfo, tp: int, quantization: str,
                                enable_expert_parallel: bool) -> None:
    """The draft model runs on the target's workers, sharded by the target's tensor_parallel_size (unquantized)."""
    problem = tensor_parallel_problem(draft, tp, "none", enable_expert_parallel, whose="the draft's")
    if problem is not None:
        both = sorted(set(tensor_parallel_sizes(draft, "none", enable_expert_parallel))
                      & set(tensor_parallel_sizes(target, quantization, enable_expert_parallel)))
        raise ValueError(f"speculative_config.model: tensor_parallel_size {tp} shards the draft too, and {problem}; "
                         f"use {_sizes(both)} (the sizes both models split over)")


def tensor_parallel_problem(model_info: ModelInfo, tp: int, quantization: str, enable_expert_parallel: bool,
                            whose: str = "the model's") -> str | None:
    """Why the checkpoint's layers cannot be split over `tp` ranks, or None when they can."""
    text = _text_config(model_info)
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    if heads % tp:
        return f"{whose} {heads} attention heads cannot be split evenly over {tp} ranks"
    if (kv_heads % tp) if tp < kv_heads else (tp % kv_heads):
        return (f"{whose} {kv_heads} KV heads can be neither split evenly over {tp} ranks nor replicated on "
                f"them ({tp} is not a multiple of {kv_heads})")
    mlp_sizes = _sharded_mlp_sizes(model_info, text, enable_expert_parallel)
    for name, size in mlp_sizes.items():
        if size % tp:
            return f"{whose} {name} {size} cannot be split evenly over {tp} ranks"
    if quantization != "none":
        row_inputs = {"attention output (heads x head_dim)": heads * head_dim, **mlp_sizes}
        for name, size in row_inputs.items():
            if size // tp % QUANT_BLOCK:
                return (f"quantization {quantization!r} keeps weights in {QUANT_BLOCK}-weight blocks along the "
                        f"input, and {whose} {name} {size} over {tp} ranks is {size // tp} per rank, not whole "
                        f"blocks")
    return quant_formats.tensor_parallel_problem(model_info, quantization, tp)


def tensor_parallel_sizes(model_info: ModelInfo, quantization: str, enable_expert_parallel: bool) -> list[int]:
    """Every tensor_parallel_size the checkpoint splits over (at most its attention heads)."""
    heads = int(_text_config(model_info)["num_attention_heads"])
    return [tp for tp in range(1, heads + 1)
            if tensor_parallel_problem(model_info, tp, quantization, enable_expert_parallel) is None]


def _sharded_mlp_sizes(model_info: ModelInfo, text: dict[str, Any], enable_expert_parallel: bool) -> dict[str, int]:
    """The intermediate sizes tensor parallelism shards: the dense MLPs', and the experts' unless expert parallel."""
    sizes: dict[str, int] = {}
    # Qwen3-MoE keeps dense MLPs in mlp_only_layers and between sparse steps.
    dense_layers = (not model_info.is_moe or text.get("mlp_only_layers")
                    or int(text.get("decoder_sparse_step") or 1) > 1)
    if dense_layers:
        sizes["intermediate_size"] = int(text["intermediate_size"])
    if model_info.is_moe and not enable_expert_parallel:
        name = "moe_intermediate_size" if text.get("moe_intermediate_size") else "intermediate_size"
        sizes[f"experts' {name}"] = int(text[name])
    return sizes


def _check_pipeline(model_info: ModelInfo, parallel: ParallelConfig) -> None:
    pp, layers = parallel.pipeline_parallel_size, model_info.num_hidden_layers
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size {pp}: the model has {layers} layers, and every stage needs at "
                         f"least one; use at most {layers}")
    partition = parallel.pp_layer_partition
    if partition is not None and sum(partition) != layers:
        raise ValueError(f"pp_layer_partition {partition}: it places {sum(partition)} layers, and the model has "
                         f"{layers}")


def _check_expert_parallel(model_info: ModelInfo, parallel: ParallelConfig, dp_lockstep: bool) -> None:
    if not parallel.enable_expert_parallel:
        return
    if not model_info.is_moe:
        raise ValueError(f"enable_expert_parallel: {model_info.architecture} has no experts (not a MoE model)")
    ep_size = parallel.tensor_parallel_size * (parallel.data_parallel_size if dp_lockstep else 1)
    if model_info.num_experts % ep_size:
        ranks = [n for n in range(1, model_info.num_experts + 1) if model_info.num_experts % n == 0]
        raise ValueError(f"enable_expert_parallel: {model_info.num_experts} experts cannot be split evenly over "
                         f"{ep_size} expert-parallel ranks (data_parallel_size x tensor_parallel_size); use "
                         f"{_sizes(ranks)} ranks")


def _text_config(model_info: ModelInfo) -> dict[str, Any]:
    assert model_info.hf_config is not None, "read_model_info keeps the checkpoint's config"
    hf = model_info.hf_config.to_dict()
    text: dict[str, Any] = hf.get("text_config", hf)
    return text


def _sizes(sizes: list[int]) -> str:
    if not sizes:
        return "none (the checkpoint runs on one device only)"
    *most, last = map(str, sizes)
    return f"{', '.join(most)} or {last}" if most else last
