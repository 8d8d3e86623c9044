"""Requests in, tokens out: the engine core, the offline LLM API, serving and the CLI."""
from raylm.cluster.llm import LLM
from raylm.cluster.outputs import CompletionOutput, RequestOutput
from raylm.common.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
