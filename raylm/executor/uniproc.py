"""One Worker in this process.

Without async scheduling the futures come back already resolved. With it, steps run in order on one background
thread, so the engine schedules step N+1 while step N's forward runs (torch releases the GIL in its kernels).
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from raylm.common.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from raylm.executor.abstract import Executor
from raylm.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.worker = Worker(self.config, distributed_init_method=self.data_parallel.init_method,
                             data_parallel=self.data_parallel)
        self.worker.init_device()
        self.worker.load_model()
        self._thread: ThreadPoolExecutor | None = None
        if self.config.scheduler_config.async_scheduling:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raylm-step")

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [self._submit(self.worker.execute_method, method, *args, **(kwargs or {})).result()]

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        return self._submit(self.worker.execute_model, scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> Future[ModelRunnerOutput | None]:
        return self._submit(self.worker.sample_tokens, grammar_output)

    def execute_dummy_batch(self) -> Future[None]:
        return self._submit(self.worker.execute_dummy_batch)

    def check_health(self) -> None:
        if not self.worker.check_health():
            raise RuntimeError("the worker is not initialized")

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self.worker.shutdown()
        self.worker.model_runner = None

    def _submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        if self._thread is not None:
            return self._thread.submit(fn, *args, **kwargs)
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as err:  # the caller sees the error when it asks for the result
            future.set_exception(err)
        return future
