"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (`arguments` is
read too), optionally after `<|python_tag|>`, several calls separated by `;`. An answer that does not start with
one is plain text."""
from __future__ import annotations

from raylm.cluster.entrypoints.openai.tool_parsers.incremental import IncrementalToolParser, PartialCall, Segment
from raylm.cluster.entrypoints.openai.tool_parsers.json_scan import scan_call_object, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(IncrementalToolParser):
    def parse(self, text: str, final: bool) -> list[Segment]:
        position = skip_whitespace(text, 0)
        if not final and PYTHON_TAG.startswith(text[position:]):
            return []  # nothing yet, or the start of the tag
        if text.startswith(PYTHON_TAG, position):
            position = skip_whitespace(text, position + len(PYTHON_TAG))
        segments: list[Segment] = []
        while position < len(text):
            call = scan_call_object(text, position) if text[position] == "{" else None
            if call is None or call.name is None:
                if call is not None and not call.invalid and call.end is None and not final:
                    break  # the name is still to come
                # Not a call: before the first one the whole answer is text; after, the rest is.
                return [*segments, text[position:]] if segments else [text]
            segments.append(PartialCall(call.name, call.arguments))
            if call.end is None:
                break
            position = skip_whitespace(text, call.end)
            if position < len(text) and text[position] == ";":
                position = skip_whitespace(text, position + 1)
        return segments
