"""Phi-3: a Llama whose checkpoints store q/k/v fused as `qkv_proj` and gate/up as `gate_up_proj` (raylm's own
layout), with LongRoPE scaling and partial rotary where the config sets them (layers.rotary_embedding reads both)."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from raylm.runner.models.llama import LlamaForCausalLM, ShardId

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Phi3ForCausalLM(LlamaForCausalLM):
    # Each fused tensor loads whole: the packed layers' weight loaders split it into q/k/v (gate/up) and take this
    # TP rank's shard of each, so no name needs mapping.
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    stacked_params_mapping: ClassVar[list[tuple[str, str, ShardId]]] = []

    def __init__(self, config: PretrainedConfig, pp_rank: int = 0, pp_size: int = 1,
                 partition: list[int] | None = None) -> None:
        window = getattr(config, "sliding_window", None)
        # A window at least the context long masks nothing (Phi-3-mini-128k and Phi-3.5-mini set 262144).
        if window is not None and window < config.max_position_embeddings:
            raise ValueError(f"sliding_window: {window} is shorter than max_position_embeddings "
                             f"({config.max_position_embeddings}); sliding-window attention is not supported")
        super().__init__(config, pp_rank, pp_size, partition)
