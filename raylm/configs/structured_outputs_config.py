"""Settings of structured output (vLLM's StructuredOutputsConfig) and of parsing the model's output back into tool
calls and reasoning, which the OpenAI server does for the same requests."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

StructuredOutputsBackend = Literal["auto", "xgrammar", "guidance"]


class StructuredOutputsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # decided once, read by every layer

    structured_outputs_backend: StructuredOutputsBackend = Field(
        "auto", description="grammar engine of constrained requests; auto: xgrammar, and guidance (llguidance) for "
                            "the schemas, regexes and grammars xgrammar cannot enforce")
    reasoning_parser: Literal["deepseek_r1", "qwen3", "openai_gptoss"] | None = Field(
        None, description="split the reasoning (<think>...</think>; GPT-OSS's analysis channel: openai_gptoss) into "
                          "reasoning_content; a grammar applies only after it ends")
    enable_auto_tool_choice: bool = Field(
        False, description="tool_choice 'auto': parse the model's own tool calls (needs tool_call_parser)")
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic", "deepseek_v3", "openai"] | None = Field(
        None, description="format of the model's tool calls for tool_choice 'auto': hermes (Qwen2.5, Qwen3, Hermes), "
                          "llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]), pythonic (Llama 3.2 / 4 Python "
                          "lists), deepseek_v3 (DeepSeek V3 / R1), openai (GPT-OSS harmony)")
