"""Per-request settings of a pooling request (an embedding), vLLM's PoolingParams: validated where the user sets
them; the engine fills what the user left to the model (its pooler config) before the request reaches the
scheduler."""
from __future__ import annotations

from dataclasses import dataclass

from raylm.configs.pooler_config import POOLING_TYPES, PoolingType


@dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None  # Matryoshka models: keep the first `dimensions` values (before normalising)
    normalize: bool | None = None  # L2-normalise the pooled vector; None: as the model's pooler config says
    pooling_type: PoolingType | None = None  # None: the model's; set by the engine before scheduling

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"PoolingParams.dimensions must be >= 1, got {self.dimensions}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"PoolingParams.pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """vLLM's name: a pooling over every prompt token needs each token's hidden state, which a cached prefix
        does not give (its KV is kept, not its hidden states); LAST needs only the last token, always computed."""
        return self.pooling_type != "LAST"
