"""Executors run one engine's Workers: in-process (uni) or as Ray actors (ray)."""
from executor.abstract import Executor
from executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
