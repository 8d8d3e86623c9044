"""LoRA adapters for tests, made by PEFT itself on a tiny checkpoint (random non-zero weights: init_lora_weights=False,
a fixed seed), and PEFT's own greedy generate as the reference."""
from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.reference import model_greedy

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int, r: int = 8, lora_alpha: int = 16,
                 target_modules: list[str] | None = None, use_rslora: bool = False) -> Path:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) with random non-zero A and B."""
    if (out / "adapter_model.safetensors").exists():
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules or ALL_TARGETS,
                        init_lora_weights=False, use_rslora=use_rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's random B is large on a tiny model: keep the adapter a perturbation of the base
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    peft_model.save_pretrained(out)
    return out


@torch.inference_mode()
def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]],
                max_tokens: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per prompt: PEFT's greedy tokens (the base model when adapter is None) and the top-5 logprobs per position."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model_greedy(model.eval(), prompts, max_tokens)
