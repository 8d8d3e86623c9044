"""The engine's check of the adapters requests name, before any reaches the scheduler: a bad adapter fails its own
request with a clear error, and nothing already loaded changes."""
from __future__ import annotations

from raylm.common.lora_request import LoRARequest
from raylm.configs import EngineConfig
from raylm.runner.lora.peft_checkpoint import check_adapter


class LoRAChecker:
    def __init__(self, config: EngineConfig) -> None:
        self.enabled = config.lora_config.enable_lora
        self.max_lora_rank = config.lora_config.max_lora_rank
        self.hf_config = config.model_info.hf_config
        self.checked: dict[int, LoRARequest] = {}  # adapters checked, by lora_int_id

    def check(self, lora_request: LoRARequest) -> None:
        """Raises ValueError unless LoRA is on, the id names no other adapter, and the checkpoint fits the model."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if not self.enabled:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled; start the engine with "
                             f"enable_lora=True")
        known = self.checked.get(lora_request.lora_int_id)
        if known == lora_request:
            return
        if known is not None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: lora_int_id {lora_request.lora_int_id} is "
                             f"already adapter {known.lora_name!r} ({known.lora_path}); give each adapter its own id")
        assert self.hf_config is not None, "read_model_info keeps the checkpoint's config"
        check_adapter(lora_request.lora_name, lora_request.lora_path, self.hf_config, self.max_lora_rank)
        self.checked[lora_request.lora_int_id] = lora_request

    def forget(self, lora_id: int) -> None:
        self.checked.pop(lora_id, None)
