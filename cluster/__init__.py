"""Requests in, tokens out: the engine core, the offline LLM API, serving and the CLI."""
from cluster.llm import LLM
from cluster.outputs import CompletionOutput, RequestOutput
from runner.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
