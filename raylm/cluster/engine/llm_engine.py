"""LLMEngine: prompts in, RequestOutputs out, over one EngineCore.

It tokenizes and checks prompts, expands n > 1 into child requests, and turns the engine
core's token deltas into text (detokenizer, stop strings) through the OutputProcessor.
"""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from raylm.cluster.core.request import POOLING_SAMPLING_PARAMS, Request
from raylm.cluster.core.structured_output import validate_structured_outputs
from raylm.cluster.engine.config_resolver import resolve_engine_config
from raylm.cluster.engine.engine_core import EngineCore
from raylm.cluster.engine.lora_checker import LoRAChecker
from raylm.cluster.engine.lora_registry import LoRARegistry
from raylm.cluster.engine.output_processor import OutputProcessor, RequestOutputKind
from raylm.cluster.engine.outputs import DPEngineDiedError, EngineSleepingError, PoolingRequestOutput, RequestOutput
from raylm.cluster.engine.pooling_checks import check_pooling_params
from raylm.cluster.models.default_model import served_model_name
from raylm.common import tracing
from raylm.common.lora_request import LoRARequest
from raylm.common.pooling_params import PoolingParams
from raylm.common.sampling_params import SamplingParams
from raylm.configs import EngineConfig, make_engine_config
from raylm.configs.gguf_metadata import get_tokenizer
from raylm.configs.model_info import ModelInfo
from raylm.configs.scheduler_defaults import UsageContext

if TYPE_CHECKING:
    from raylm.cluster.dp.dp_client import DPEngineCoreClient

PromptType: TypeAlias = "str | dict[str, Any]"
FRONTEND_TRACE_PID = 1_000_000  # the process that runs LLMEngine, when the engines run elsewhere (DP)


class LLMEngine:
    def __init__(self, config: EngineConfig, usage_context: UsageContext = "engine_context") -> None:
        config = resolve_engine_config(config, usage_context)
        self.config = config
        self.model_info: ModelInfo = config.model_info
        assert config.model_config.tokenizer is not None, "resolution sets the tokenizer (the model's by default)"
        self.tokenizer = get_tokenizer(config.model_config.tokenizer)
        eos = set(self.model_info.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.engine_core: EngineCore | DPEngineCoreClient
        parallel = config.parallel_config
        if config.observability_config.trace_file and parallel.data_parallel_size > 1:
            tracing.enable("frontend (LLMEngine)", pid=FRONTEND_TRACE_PID)
        if parallel.data_parallel_size > 1 and parallel.data_parallel_backend == "ray":
            from raylm.cluster.dp.dp_client import DPEngineCoreClient

            self.engine_core = DPEngineCoreClient(config)
        else:
            self.engine_core = EngineCore(config)
        self.output_processor = OutputProcessor(self.tokenizer, eos)
        self.lora_checker = LoRAChecker(config)
        # Requests without a seed get one drawn here: every rank of an engine then samples them identically, and
        # they sample the same whichever data-parallel engine serves them.
        self._seed_rng = random.Random(config.model_config.seed)
        self._trace_events: list[dict[str, Any]] = []
        self._sleeping = False  # kept here so that add_request needs no call to (DP) engines
        # Adapters by name; the lora_modules are loaded now, so that a bad one fails the start.
        self.lora_registry = LoRARegistry(config.lora_config, served_model_name(config.model_config))
        try:
            for name, path in self.lora_registry.static_modules.items():
                lora_request = self.lora_registry.new_request(name, path)
                self.add_lora(lora_request)
                self.lora_registry.register(lora_request)
        except BaseException:
            self.engine_core.shutdown()
            raise

    @classmethod
    def from_settings(cls, config_file: str | None = None, **overrides: Any) -> LLMEngine:
        return cls(make_engine_config(config_file, **overrides))

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = [int(t) for t in prompt["prompt_token_ids"]]
            bad = [t for t in token_ids if not 0 <= t < self.model_info.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids: ids {bad[:5]} are outside the vocabulary "
                                 f"[0, {self.model_info.vocab_size})")
            return prompt.get("prompt"), token_ids
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self.process_prompt(prompt["prompt"])
        raise ValueError(f"a prompt is a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; got {prompt!r}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    priority: int = 0, output_kind: RequestOutputKind = "cumulative",
                    lora_request: LoRARequest | None = None) -> tuple[list[int], int]:
        """Queue one prompt (n sequences; or, with PoolingParams, one pooling request); returns its prompt token ids
        and the index of the (data-parallel) engine that serves it (of its first sequence). Bad input raises
        ValueError."""
        if self._sleeping:
            raise EngineSleepingError(f"request {request_id}: the engine is sleeping: call wake_up() first")
        text, token_ids = self.process_prompt(prompt)
        if not token_ids:
            raise ValueError("prompt: it is empty (0 tokens)")
        if isinstance(params, PoolingParams):
            return token_ids, self._add_pooling_request(request_id, token_ids, params, priority, lora_request)
        self._check_request(params, priority)
        if lora_request is not None:
            self.lora_checker.check(lora_request)
        if params.seed is None:
            params = replace(params, seed=self._seed_rng.getrandbits(62))
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        engines = []
        for index, child_id in enumerate(child_ids):
            child_params = params if params.n == 1 else _child_params(params, index)
            engines.append(self.engine_core.add_request(Request(child_id, token_ids, child_params, self.eos_token_ids,
                                                                priority=priority, lora_request=lora_request)))
            self.output_processor.add_request(child_id, text, token_ids, child_params,
                                              parent_id=None if params.n == 1 else request_id, index=index,
                                              output_kind=output_kind)
        return token_ids, engines[0]

    def _add_pooling_request(self, request_id: str, token_ids: list[int], params: PoolingParams, priority: int,
                             lora_request: LoRARequest | None) -> int:
        self._check_priority(priority)
        if lora_request is not None:
            self.lora_checker.check(lora_request)
        params = check_pooling_params(params, self.config)
        engine = self.engine_core.add_request(Request(request_id, token_ids, POOLING_SAMPLING_PARAMS,
                                                      self.eos_token_ids, priority=priority,
                                                      lora_request=lora_request, pooling_params=params))
        self.output_processor.add_pooling_request(request_id, token_ids)
        return engine

    def _check_request(self, params: SamplingParams, priority: int) -> None:
        vocab_size = self.model_info.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"SamplingParams.{name} must be <= the vocabulary size ({vocab_size}), got {value}")
        outside = [token for token in params.logit_bias or {} if not 0 <= token < vocab_size]
        if outside:  # the sampler would index the logits with them
            raise ValueError(f"logit_bias: token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})")
        if params.structured_outputs is not None:  # refused here, with what is unsupported, not in the engine
            validate_structured_outputs(params.structured_outputs, self.config.resolved.structured_outputs_backends)
        self._check_priority(priority)

    def _check_priority(self, priority: int) -> None:
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} is given but scheduling_policy is "
                             f"{self.config.scheduler_config.scheduling_policy!r}: set scheduling_policy='priority'")

    def abort_request(self, request_ids: list[str]) -> None:
        to_abort = [child for rid in request_ids for child in self.output_processor.abort_request(rid)]
        self.engine_core.abort_requests(to_abort)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        try:
            core_outputs = self.engine_core.step()
        except DPEngineDiedError as err:  # in user-facing request ids, with their other sequences aborted
            parents = self.output_processor.parent_ids(err.request_ids)
            self.abort_request(parents)
            raise DPEngineDiedError(str(err), parents, err.fatal) from None
        with tracing.span("process_outputs", num_outputs=len(core_outputs)):
            processed = self.output_processor.process_outputs(core_outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter and read it into every worker's host cache ahead of its requests; False if they held it."""
        self.lora_checker.check(lora_request)
        return any(self.engine_core.collective_rpc("add_lora", (lora_request,)))

    def remove_lora(self, lora_id: int) -> bool:
        """Drop an adapter from the workers' caches (requests still running with it reload it); False if unknown."""
        self.lora_checker.forget(lora_id)
        return any(self.engine_core.collective_rpc("remove_lora", (lora_id,)))

    def list_loras(self) -> set[int]:
        """The adapter ids in the workers' host caches."""
        return set().union(*self.engine_core.collective_rpc("list_loras"))

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and offload (level 1) or drop (level 2) the weights, on every worker; only while no
        request is unfinished. Requests are refused until wake_up."""
        self.engine_core.sleep(level)
        self._sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore the weights and/or the KV cache ("weights", "kv_cache"; all when `tags` is None)."""
        self.engine_core.wake_up(tags)
        self._sleeping = self.engine_core.is_sleeping()

    def is_sleeping(self) -> bool:
        return self._sleeping

    def write_trace(self) -> None:
        """Write the timeline so far (every engine and rank) to `trace_file`, as Chrome trace JSON."""
        trace_file = self.config.observability_config.trace_file
        assert trace_file, "trace_file is not set"
        self._trace_events += [*tracing.drain(), *self.engine_core.drain_trace()]
        Path(trace_file).write_text(json.dumps({"traceEvents": self._trace_events, "displayTimeUnit": "ms"}))

    def shutdown(self) -> None:
        if self.config.observability_config.trace_file:
            self.write_trace()
            tracing.disable()
        self.engine_core.shutdown()


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Children differ in their seed, so each samples its own sequence. Only the first reports the prompt
    logprobs; the others skip recomputing the prompt and share its KV blocks through the prefix cache."""
    seed = None if params.seed is None else params.seed + index
    return replace(params, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None)
