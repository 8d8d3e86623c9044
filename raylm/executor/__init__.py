"""Executors run one engine's Workers: in-process (uni) or as Ray actors (ray)."""
from raylm.executor.abstract import Executor
from raylm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
