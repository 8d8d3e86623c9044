"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from tqdm import tqdm

from raylm.cluster.engine.llm_engine import LLMEngine, PromptType
from raylm.cluster.engine.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from raylm.cluster.engine.stats import LoggingStatLogger
from raylm.cluster.entrypoints.openai.forced_tool_calls import forced_tool_constraint
from raylm.common.lora_request import LoRARequest
from raylm.common.pooling_params import PoolingParams
from raylm.common.sampling_params import SamplingParams
from raylm.configs import EngineConfig

logger = logging.getLogger(__name__)


class LLM:
    """`LLM(model=PATH or None, config_file=None, **settings)`: settings use the config field names
    (`max_num_seqs`, `block_size`, `tensor_parallel_size`, ...); None: the default model
    (cluster.models.default_model)."""

    def __init__(self, model: str | None = None, config_file: str | None = None, **settings: Any) -> None:
        self._start(LLMEngine.from_settings(config_file, model=model, **settings))

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        """An LLM over a config built (or resolved) beforehand."""
        llm = cls.__new__(cls)
        llm._start(LLMEngine(config, "llm_class"))
        return llm

    def _start(self, engine: LLMEngine) -> None:
        self.llm_engine = engine
        observability = engine.config.observability_config
        self.stat_logger = (None if observability.disable_log_stats
                            else LoggingStatLogger(observability.log_stats_interval_s))
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
                 ) -> list[RequestOutput]:
        """`lora_request`: the adapter of every prompt, or one per prompt (None: the base model); a LoRARequest, or
        the name of one of the lora_modules. A sequence the engine failed (its grammar, say) comes back with
        finish_reason "error" and `error` saying why, and is logged as a warning; the other prompts' outputs are
        whole."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = _per_prompt(sampling_params, len(prompts), SamplingParams)
        loras = self._lora_per_prompt(lora_request, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")

        outputs = self._run_requests(prompts, params_list, priorities, loras, use_tqdm)
        return [output for output in outputs if isinstance(output, RequestOutput)]

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: one vector per prompt (`.outputs.embedding`), the model's hidden states pooled as its
        pooler config says (the checkpoint's sentence-transformers modules, or the pooler_config setting), through
        the same scheduler as generate (the two may share an engine's steps)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = _per_prompt(pooling_params, len(prompts), PoolingParams)
        loras = self._lora_per_prompt(lora_request, len(prompts))
        outputs = self._run_requests(prompts, params_list, [0] * len(prompts), loras, use_tqdm)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs
                if isinstance(output, PoolingRequestOutput)]

    def _run_requests(self, prompts: Sequence[PromptType], params_list: Sequence[SamplingParams | PoolingParams],
                      priorities: list[int], loras: list[LoRARequest | None], use_tqdm: bool,
                      ) -> list[RequestOutput | PoolingRequestOutput]:
        engine = self.llm_engine
        request_ids = [str(next(self._counter)) for _ in prompts]
        try:
            for request_id, prompt, params, prio, lora in zip(request_ids, prompts, params_list, priorities, loras):
                engine.add_request(request_id, prompt, params, priority=prio, output_kind="final", lora_request=lora)
            finished = self._run_engine(len(prompts), use_tqdm)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        return [finished[request_id] for request_id in request_ids]

    def _lora_per_prompt(self, lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None,
                         n: int) -> list[LoRARequest | None]:
        given = list(lora_request) if isinstance(lora_request, Sequence) and not isinstance(lora_request, str) else [
            lora_request] * n
        if len(given) != n:
            raise ValueError(f"lora_request has {len(given)} entries for {n} prompts: give one, or one per prompt")
        loras = []
        for lora in given:
            if isinstance(lora, str):
                named = self.llm_engine.lora_registry.get(lora)
                if named is None:
                    raise ValueError(f"lora_request {lora!r}: no adapter of that name (lora_modules: "
                                     f"{sorted(self.llm_engine.lora_registry.adapters)})")
                lora = named
            loras.append(lora)
        return loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests (vLLM's LLMEngine.add_lora); False if it was loaded."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()
    def chat(self, messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
             tool_choice: str | dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or several, each through the
        tokenizer's chat template (with `tools`, OpenAI's function definitions), then generated like a prompt.
        `tool_choice` "required" or a named function constrains the output as the OpenAI server does: the text is
        then a JSON array of {"name", "parameters"} calls (required) or the named function's arguments."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, tools=tools,
                                                 add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        constraint = forced_tool_constraint(tools or [], tool_choice)
        if constraint is not None:
            params_list = _per_prompt(sampling_params, len(prompts), SamplingParams)
            if any(params.structured_outputs is not None for params in params_list):
                raise ValueError("tool_choice: a forced tool call constrains the output itself; the sampling params "
                                 "must not carry structured_outputs too")
            sampling_params = [dataclasses.replace(params, structured_outputs=constraint) for params in params_list]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput | PoolingRequestOutput]:
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        with tqdm(total=num_requests, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            num_output_tokens = 0
            while self.llm_engine.has_unfinished_requests():
                if self.stat_logger is not None and self.stat_logger.due():
                    for engine_index, stats in enumerate(self.llm_engine.engine_core.engine_stats()):
                        self.stat_logger.record(engine_index, stats)
                for output in self.llm_engine.step():
                    if isinstance(output, PoolingRequestOutput):
                        finished[output.request_id] = output
                        bar.update(1)
                    elif output.finished:
                        finished[output.request_id] = output
                        for completion in output.outputs:  # returned with the others: the error is said here
                            if completion.error is not None:
                                logger.warning("request %s (sequence %d) failed: %s", output.request_id,
                                               completion.index, completion.error)
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        rate = num_output_tokens / max(bar.format_dict["elapsed"], 1e-9)
                        bar.set_postfix_str(f"output {rate:.0f} tok/s", refresh=False)
        return finished

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call a Worker method (by name) on every worker of every engine; results in global rank order."""
        return self.llm_engine.engine_core.collective_rpc(method, args)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.engine_core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the GPU memory while idle (vLLM's sleep mode): the KV cache always; the weights are offloaded to CPU
        memory (level 1) or dropped and reloaded from the checkpoint on wake_up (level 2)."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: all, or only ["weights"] / ["kv_cache"] (e.g. weights first, to update them)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()


P = TypeVar("P", SamplingParams, PoolingParams)


def _per_prompt(params: P | Sequence[P] | None, n: int, kind: type[P]) -> list[P]:
    if params is None:
        return [kind()] * n
    if not isinstance(params, Sequence):
        return [params] * n
    given = list(params)
    if len(given) != n:
        name = "sampling_params" if kind is SamplingParams else "pooling_params"
        raise ValueError(f"{name} has {len(given)} entries for {n} prompts: give one, or one per prompt")
    return given
