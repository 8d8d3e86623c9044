"""A tiny checkpoint whose tokenizer knows the reasoning and tool-call markers as single tokens and whose chat
template takes `tools` (Qwen's hermes format), with a model vocabulary larger than the tokenizer's (vocab padding)."""
from __future__ import annotations

from pathlib import Path

from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.cluster.models.tiny_tokenizer import build_tokenizer

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
MODEL_VOCAB = 512
TOKENIZER_VOCAB = 500  # + the 4 markers: 8 ids of the model's vocabulary that no token uses
HERMES_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start|>system\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.tool_calls %}<|start|>assistant\n{% for call in message.tool_calls %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|end|>\n"
    "{% else %}<|start|>{{ message.role }}\n{{ message.content }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def make_tool_model(folder: Path) -> Path:
    path = make_tiny_model(folder, arch="qwen2", num_layers=2, vocab_size=MODEL_VOCAB)
    tokenizer = build_tokenizer(TOKENIZER_VOCAB, 0)
    tokenizer.add_tokens(MARKERS)  # not special: they stay in the text, where the parsers find them
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(path)
    return path
