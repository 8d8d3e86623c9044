"""One Worker in this process: futures come back already resolved."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from executor.abstract import Executor
from runner.outputs import ModelRunnerOutput, SchedulerOutput
from worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.worker = Worker(self.config, self.model_info)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [self.worker.execute_method(method, *args, **(kwargs or {}))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        return _resolved(self.worker.execute_model, scheduler_output)

    def sample_tokens(self) -> Future[ModelRunnerOutput | None]:
        return _resolved(self.worker.sample_tokens)

    def check_health(self) -> None:
        if not self.worker.check_health():
            raise RuntimeError("the worker is not initialized")

    def shutdown(self) -> None:
        self.worker.model_runner = None


def _resolved(fn: Any, *args: Any) -> Future:
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as err:  # the caller sees the error when it asks for the result
        future.set_exception(err)
    return future
