"""Per-request sampling settings, validated where the user sets them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raylm.common.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
FLOAT32_MAX = 3.4028234663852886e38  # the runner keeps the settings as float32
# The smallest positive float32: a repetition penalty below it is 0 in the runner, and -inf (a masked token) x 0 is NaN.
FLOAT32_MIN_POSITIVE = 1.401298464324817e-45


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top-n logprobs of each sampled token (the token itself always)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's pass-through for extensions; "kv_transfer_params" there reaches the engine's KV connector.
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (a grammar)

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check("n", self.n >= 1, "must be >= 1")
        self._check("temperature", 0.0 <= self.temperature <= FLOAT32_MAX, f"must be in [0, {FLOAT32_MAX:g}]")
        self._check("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]")
        self._check("top_k", self.top_k >= 0, "must be -1, 0 (all tokens) or a positive count")
        self._check("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]")
        self._check("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1")
        self._check("min_tokens", self.min_tokens >= 0, "must be >= 0")
        self._check("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
                    f"must be <= max_tokens ({self.max_tokens})")
        self._check("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]")
        self._check("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]")
        self._check("repetition_penalty", FLOAT32_MIN_POSITIVE <= self.repetition_penalty <= FLOAT32_MAX,
                    f"must be in [{FLOAT32_MIN_POSITIVE:g}, {FLOAT32_MAX:g}] (> 0 as a float32)")
        self._check("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0")
        self._check("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, "must be >= 0")
        self._check("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings")
        self._check("seed", self.seed is None or isinstance(self.seed, int), "must be an integer")

    def _check(self, name: str, ok: bool, rule: str) -> None:
        if not ok:
            raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
