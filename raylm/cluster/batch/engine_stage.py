"""One processor replica: a Ray Data actor that runs an AsyncLLM and feeds it every row of each batch it holds at once.

Ray Data gives the actor up to `max_concurrent_batches` batches concurrently (an async UDF on one event loop), so the
engine's continuous batching runs across all of their rows: a batch's slowest row holds back only that batch's
output, never the engine. A batch is yielded whole, once every row is done: a replica that dies mid-batch has emitted
nothing of it, and Ray Data's retry of the batch on a restarted replica writes each row exactly once.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pyarrow as pa
import torch

from raylm.cluster.batch.rows import ERROR_COLUMN, RowError, describe_row, result_table, sampling_params_from
from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.engine.llm_engine import PromptType
from raylm.cluster.engine.outputs import EngineDeadError
from raylm.cluster.serve.app import replica_torch_threads
from raylm.common.sampling_params import SamplingParams
from raylm.configs import EngineConfig


class EngineStageUDF:
    def __init__(self, engine_config: EngineConfig, apply_chat_template: bool,
                 should_continue_on_error: bool) -> None:
        torch.set_num_threads(replica_torch_threads())  # Ray sets OMP_NUM_THREADS to the actor's CPUs otherwise
        self.engine = AsyncLLM(engine_config)
        self.apply_chat_template = apply_chat_template
        self.should_continue_on_error = should_continue_on_error

    async def __call__(self, batch: pa.Table) -> AsyncIterator[pa.Table]:
        await self.engine.wait_until_ready()
        rows = batch.to_pylist()
        tasks = [asyncio.ensure_future(self._generate_row(row)) for row in rows]
        try:
            results = await asyncio.gather(*tasks)
        finally:  # a row that failed the batch aborts the others' requests
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        yield result_table(batch, results, self.should_continue_on_error)

    async def _generate_row(self, row: dict[str, Any]) -> dict[str, Any]:
        try:
            result = await self._generate(self._prompt(row), sampling_params_from(row.get("sampling_params")))
        except EngineDeadError:
            raise  # the replica's fault, not the row's
        except (ValueError, TypeError) as err:
            if not self.should_continue_on_error:
                raise RowError(f"{describe_row(row)}: {err}") from None
            return {ERROR_COLUMN: f"{type(err).__name__}: {err}"}
        return result | ({ERROR_COLUMN: ""} if self.should_continue_on_error else {})

    def _prompt(self, row: dict[str, Any]) -> PromptType:
        if row.get("messages") is not None:
            if not self.apply_chat_template:
                raise ValueError("messages: the processor has apply_chat_template=False; give a prompt, or set it")
            tokenizer = self.engine.tokenizer
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        if isinstance(row.get("prompt"), str):
            return row["prompt"]
        raise ValueError(f"the row has neither a 'prompt' (text) nor 'messages' (chat); its columns: {sorted(row)}")

    async def _generate(self, prompt: PromptType, params: SamplingParams) -> dict[str, Any]:
        """The row's result from the request's final output alone: no per-token output to wake this loop."""
        start = time.monotonic()
        async with aclosing(self.engine.generate(f"batch-{uuid.uuid4().hex}", prompt, params,
                                                 output_kind="final")) as outputs:
            output = await anext(outputs)
        end = time.monotonic()
        completion = output.outputs[0]
        if completion.finish_reason == "error":
            raise ValueError(f"the engine failed the request: {completion.error}")
        first_token_time = output.first_token_time or end
        return {"generated_text": completion.text, "generated_tokens": list(completion.token_ids),
                "num_input_tokens": len(output.prompt_token_ids), "num_generated_tokens": len(completion.token_ids),
                "finish_reason": completion.finish_reason,
                "time_to_first_token": first_token_time - start, "time_taken_llm": end - start}

    def __del__(self) -> None:
        if hasattr(self, "engine"):
            self.engine.shutdown()
