"""Tool-call parsers: the model's own tool calls (tool_choice "auto") read back from its text, by vLLM's names."""
from raylm.cluster.entrypoints.openai.tool_parsers.abstract import ExtractedToolCalls, ToolParser, new_tool_call_id
from raylm.cluster.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from raylm.cluster.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from raylm.cluster.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from raylm.cluster.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from raylm.cluster.entrypoints.openai.tool_parsers.openai import OpenAIToolParser
from raylm.cluster.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "openai": OpenAIToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ToolParser", "get_tool_parser", "new_tool_call_id"]
