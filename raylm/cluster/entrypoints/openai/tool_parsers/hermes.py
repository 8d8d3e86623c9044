"""Hermes tool calls (Qwen2.5, Qwen3, Hermes 2/3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, after any plain text."""
from __future__ import annotations

from raylm.cluster.entrypoints.openai.tool_parsers.incremental import IncrementalToolParser, PartialCall, Segment
from raylm.cluster.entrypoints.openai.tool_parsers.json_scan import partial_suffix, scan_call_object, skip_whitespace

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(IncrementalToolParser):
    def parse(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        position = 0
        while True:
            start = text.find(START, position)
            if start < 0:
                rest = text[position:]
                segments.append(rest if final else rest[: len(rest) - partial_suffix(rest, START)])
                return segments
            segments.append(text[position:start])
            end = text.find(END, start)
            block_end = len(text) if end < 0 else end + len(END)
            body = text[start + len(START): len(text) if end < 0 else end]
            if end < 0 and not final:
                body = body[: len(body) - partial_suffix(body, END)]  # broken arguments must not take the marker
            first = skip_whitespace(body, 0)
            call = scan_call_object(body, first) if first < len(body) else None
            if call is not None and call.name is not None:
                segments.append(PartialCall(call.name, call.arguments))
            elif end < 0 and not final:
                return segments  # a call, or text once its block ends: not known yet
            else:
                segments.append(text[start:block_end])  # not a call: the block is text
            if end < 0:
                return segments
            position = block_end
