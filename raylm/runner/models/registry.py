"""config.json `architectures[0]` -> model class."""
from __future__ import annotations

from typing import TYPE_CHECKING

from raylm.runner.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from raylm.runner.models.gemma2 import Gemma2ForCausalLM
from raylm.runner.models.gemma3 import Gemma3ForCausalLM
from raylm.runner.models.gpt_oss import GptOssForCausalLM
from raylm.runner.models.llama import LlamaForCausalLM
from raylm.runner.models.mistral import MistralForCausalLM
from raylm.runner.models.mixtral import MixtralForCausalLM
from raylm.runner.models.phi3 import Phi3ForCausalLM
from raylm.runner.models.qwen2 import Qwen2ForCausalLM
from raylm.runner.models.qwen3 import Qwen3ForCausalLM
from raylm.runner.models.qwen3_moe import Qwen3MoeForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_MODELS: dict[str, type[LlamaForCausalLM]] = {  # each model is a Llama with its own layers
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def check_architecture(architecture: str) -> None:
    """Raise, naming the supported ones, unless raylm has a model for `architecture` (config.json's first)."""
    if architecture not in _MODELS:
        raise ValueError(f"model: unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def get_model_cls(hf_config: PretrainedConfig) -> type[LlamaForCausalLM]:
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"the model config names no architecture; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    check_architecture(architectures[0])
    return _MODELS[architectures[0]]
