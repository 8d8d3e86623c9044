"""What a batch processor runs: the engine of each replica, how many replicas, how rows reach them (Ray Data's
`ray.data.llm.vLLMEngineProcessorConfig`, with raylm's settings as `engine_kwargs`)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from raylm.configs import EngineConfig, make_engine_config


class EngineProcessorConfig(BaseModel):
    """`concurrency`: a fixed pool of n replicas, or (min, max) for a pool Ray Data grows and shrinks with the rows
    waiting. Each replica runs one engine and holds up to `max_concurrent_batches` batches of `batch_size` rows in it
    at once, so that continuous batching runs across them. `placement_group_config` ({"bundles": [...], "strategy":
    ...}) replaces the replica's resources, which otherwise are its engine's bundles (executor/placement.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_source: str | None = Field(None, description="checkpoint path or GGUF file; None: raylm's default model")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="raylm engine settings (`raylm serve` "
                                                                            "flags' names)")
    config_file: str | None = Field(None, description="YAML of engine settings, under engine_kwargs")
    concurrency: int | tuple[int, int] = 1
    batch_size: int = Field(64, ge=1)
    max_concurrent_batches: int = Field(4, ge=1)
    apply_chat_template: bool = True
    should_continue_on_error: bool = False
    placement_group_config: dict[str, Any] | None = None
    runtime_env: dict[str, Any] | None = None

    @field_validator("concurrency")
    @classmethod
    def _check_concurrency(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        sizes = (value, value) if isinstance(value, int) else value
        if not 1 <= sizes[0] <= sizes[1]:
            raise ValueError(f"concurrency: n >= 1 replicas or (min, max) with 1 <= min <= max; got {value!r}")
        return value

    @field_validator("placement_group_config")
    @classmethod
    def _check_placement(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and (not value.get("bundles") or set(value) - {"bundles", "strategy"}):
            raise ValueError(f"placement_group_config: expected {{'bundles': [resource dicts], 'strategy': ...}}; "
                             f"got {value!r}")
        return value

    def pool_sizes(self) -> tuple[int, int]:
        return (self.concurrency, self.concurrency) if isinstance(self.concurrency, int) else self.concurrency

    def engine_config(self) -> EngineConfig:
        """Each replica's engine config (resolved in the replica); bad settings fail here, before any replica."""
        settings = {"model": self.model_source, **self.engine_kwargs}
        config = make_engine_config(self.config_file, **settings)
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError(f"engine_kwargs: data_parallel_size={config.parallel_config.data_parallel_size}: a "
                             f"replica runs one engine; set concurrency for more replicas")
        return config
