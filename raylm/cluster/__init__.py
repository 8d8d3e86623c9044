"""Requests in, tokens out, in rooms (lowest first; pyproject's [tool.raylm.rooms], tests/test_rooms.py):
models (what model=None means) < core (what the engine core schedules with) < engine and dp (the engine, and its data
parallel engines) < tools (draft cutter, bench client) < entrypoints (LLM, CLI, OpenAI server) and serve (Ray Serve)."""
from raylm.cluster.engine.outputs import CompletionOutput, RequestOutput
from raylm.cluster.entrypoints.llm import LLM
from raylm.common.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
