"""The config settings a GGUF file carries for the mixture-of-experts families: Mixtral (llama.cpp writes it as a
`llama` file with experts), Qwen3-MoE (`qwen3moe`), DeepSeek V2 / V3 (`deepseek2`: multi-head latent attention, shared
experts, dense first layers, group-limited or bias-corrected routing, DeepSeek's YaRN) and GPT-OSS (`gpt-oss`). Keys are
those llama.cpp's converter writes; where llama.cpp hard-codes a value instead of storing it (Qwen3-MoE's renormalised
top-k weights, GPT-OSS's layer pattern and clamped SwiGLU), the same value is used here.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

Getter = Callable[..., Any]  # get(key, default=...) -> the `{arch}.{key}` metadata value

MOE_ARCHITECTURES = ("qwen3moe", "deepseek2", "gpt-oss")
_SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID; 1 is softmax
# What llama.cpp runs GPT-OSS with: sliding and full layers alternating from a sliding one, and HF's SwiGLU clamp.
_GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def is_moe_file(arch: str, get: Getter) -> bool:
    """Whether the file holds one of the MoE families (a llama file with experts is Mixtral)."""
    return arch in MOE_ARCHITECTURES or (arch == "llama" and int(get("expert_count", 0)) > 0)


def moe_settings(arch: str, get: Getter, tensors: frozenset[str], rope: dict[str, Any]) -> dict[str, Any]:
    """The config settings (architectures and model_type included) of a MoE file, replacing the Llama-shaped ones
    where they differ; `rope` is the rope_parameters read from the file's rope keys."""
    experts = dict(num_experts_per_tok=int(get("expert_used_count")))
    if arch == "llama":
        return dict(architectures=["MixtralForCausalLM"], model_type="mixtral", sliding_window=None,
                    num_local_experts=int(get("expert_count")), rope_parameters=rope, **experts)
    if arch == "qwen3moe":
        layers = int(get("block_count"))
        return dict(model_type="qwen3_moe", num_experts=int(get("expert_count")),
                    moe_intermediate_size=int(get("expert_feed_forward_length")),
                    norm_topk_prob=bool(get("expert_weights_norm", True)), decoder_sparse_step=1,
                    mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
                    use_sliding_window=False, rope_parameters=rope, **experts)
    if arch == "gpt-oss":
        layers = int(get("block_count"))
        if rope["rope_type"] == "yarn":  # as GPT-OSS's own config: the ramp's bounds unrounded
            rope = {**rope, **_yarn_betas(get), "truncate": False}
        return dict(model_type="gpt_oss", num_local_experts=int(get("expert_count")),
                    intermediate_size=int(get("expert_feed_forward_length")),
                    sliding_window=int(get("attention.sliding_window")), attention_bias=True,
                    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                    rope_parameters=rope, **_GPT_OSS_SWIGLU, **experts)
    return _deepseek2(get, rope, experts)


def _deepseek2(get: Getter, rope: dict[str, Any], experts: dict[str, Any]) -> dict[str, Any]:
    """MLA's ranks and head sizes (files from before llama.cpp split kv_b store them as key / value lengths, newer
    ones as the _mla lengths beside the latent's), the routing, and DeepSeek's YaRN mscale (llama.cpp keeps
    0.1 * mscale_all_dim as the log multiplier and takes mscale equal to it)."""
    rope_dim = int(get("rope.dimension_count"))
    qk_head_dim = int(get("attention.key_length_mla", None) or get("attention.key_length"))
    v_head_dim = int(get("attention.value_length_mla", None) or get("attention.value_length"))
    q_lora_rank = get("attention.q_lora_rank", None)
    sigmoid = int(get("expert_gating_func", 1)) == _SIGMOID
    groups, groups_used = int(get("expert_group_count", 1)), int(get("expert_group_used_count", 1))
    if rope["rope_type"] == "yarn":
        mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope = {**rope, "mscale": mscale, "mscale_all_dim": mscale, **_yarn_betas(get)}
    settings: dict[str, Any] = dict(
        architectures=["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if sigmoid else "deepseek_v2",
        num_key_value_heads=int(get("attention.head_count")), head_dim=rope_dim,
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None, kv_lora_rank=int(get("attention.kv_lora_rank")),
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_head_dim - rope_dim, v_head_dim=v_head_dim,
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        n_routed_experts=int(get("expert_count")), n_shared_experts=int(get("expert_shared_count", 0)),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(get("expert_weights_norm", False)), n_group=groups, topk_group=groups_used,
        rope_interleave=True,  # llama.cpp rotates DeepSeek's rope dims in adjacent pairs, as the checkpoints store them
        rope_parameters=rope, **experts)
    if not sigmoid:
        settings["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return settings


def _yarn_betas(get: Getter) -> dict[str, float]:
    """YaRN's ramp bounds: the file's, else llama.cpp's defaults (HF's too)."""
    return {"beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0))}
