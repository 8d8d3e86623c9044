"""What llama.cpp's converter (convert_hf_to_gguf.py) writes for the MoE families, for tests/gguf_files.py: the keys
beyond Llama's, and the checkpoint's tensors under the names and layouts it maps (experts stacked per layer,
DeepSeek's kv_b split into k_b (transposed) and v_b, GPT-OSS's interleaved gate_up split and transposed)."""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import gguf
import numpy as np

MOE_ARCHS = {"MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe", "DeepseekV2ForCausalLM": "deepseek2",
             "DeepseekV3ForCausalLM": "deepseek2", "GptOssForCausalLM": "gpt-oss"}
ROUTERS = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight")  # kept float32
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def add_moe(writer: gguf.GGUFWriter, config: dict[str, Any], arch: str, rope: dict[str, Any],
            split_kv_b: bool = True) -> None:
    """The expert keys of every MoE family, DeepSeek's MLA and routing keys (split_kv_b False: as llama.cpp wrote them
    before it split kv_b), and YaRN where the rope has it."""
    writer.add_expert_count(config.get("num_local_experts") or config.get("num_experts") or config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    elif arch == "gpt-oss":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
    elif arch == "deepseek2":
        _add_deepseek2(writer, config, split_kv_b)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if arch == "deepseek2":
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _add_deepseek2(writer: gguf.GGUFWriter, config: dict[str, Any], split_kv_b: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters: MLA run as MQA over the latent (one KV head of kv_lora_rank + rope), the
    per-head sizes as the _mla lengths (before the split: every head a KV head, the per-head sizes as the key / value
    lengths), the dense first layers and the routing."""
    kv_lora_rank, rope_dim = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(kv_lora_rank)
    if split_kv_b:
        writer.add_head_count_kv(1)
        writer.add_key_length(kv_lora_rank + rope_dim)
        writer.add_value_length(kv_lora_rank)
        writer.add_key_length_mla(config["qk_nope_head_dim"] + rope_dim)
        writer.add_value_length_mla(config["v_head_dim"])
    else:
        writer.add_key_length(config["qk_nope_head_dim"] + rope_dim)
        writer.add_value_length(config["v_head_dim"])
    writer.add_rope_dimension_count(rope_dim)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    v3 = config["architectures"][0] == "DeepseekV3ForCausalLM"  # V3's scoring_func is sigmoid, V2's softmax
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)


def moe_tensors(tensors: dict[str, np.ndarray], config: dict[str, Any], split_kv_b: bool = True
                ) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as the converter hands them to the gguf package's name map (unchanged for the other
    families)."""
    if config["architectures"][0] not in MOE_ARCHS:
        return tensors
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    for name, weight in tensors.items():
        match = _EXPERT.match(name)
        if match:
            experts[(match[1], match[3])][int(match[2])] = weight
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
            kv_b = weight.reshape(heads, nope + config["v_head_dim"], weight.shape[-1])
            out[name.replace("kv_b_proj", "k_b_proj")] = kv_b[:, :nope].transpose(0, 2, 1).copy()
            out[name.replace("kv_b_proj", "v_b_proj")] = kv_b[:, nope:].copy()
        elif name.endswith("e_score_correction_bias"):
            out[name.replace("e_score_correction_bias", "e_score_correction.bias")] = weight
        elif name.endswith("self_attn.sinks"):
            out[name + ".weight"] = weight
        elif name.endswith("experts.gate_up_proj"):  # GPT-OSS: [experts, hidden, 2 * inter], gate / up interleaved
            out[name.replace("gate_up_proj", "gate_proj.weight")] = weight[..., ::2].transpose(0, 2, 1).copy()
            out[name.replace("gate_up_proj", "up_proj.weight")] = weight[..., 1::2].transpose(0, 2, 1).copy()
        elif name.endswith("experts.gate_up_proj_bias"):
            out[name.replace("gate_up_proj_bias", "gate_proj.bias")] = weight[..., ::2].copy()
            out[name.replace("gate_up_proj_bias", "up_proj.bias")] = weight[..., 1::2].copy()
        elif name.endswith("experts.down_proj"):  # GPT-OSS: [experts, inter, hidden]
            out[name + ".weight"] = weight.transpose(0, 2, 1).copy()
        elif name.endswith("experts.down_proj_bias"):
            out[name.replace("down_proj_bias", "down_proj.bias")] = weight
        else:
            out[name] = weight
    for (prefix, proj), by_expert in experts.items():  # stacked [experts, out, in], as the converter merges them
        out[f"{prefix}.{proj}.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out
