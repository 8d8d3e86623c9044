"""Reasoning parsers: where a model's <think>...</think> ends, and its text split into reasoning and content."""
from raylm.cluster.core.reasoning.think_parser import ReasoningParser, ReasoningStream, get_reasoning_parser

__all__ = ["ReasoningParser", "ReasoningStream", "get_reasoning_parser"]
