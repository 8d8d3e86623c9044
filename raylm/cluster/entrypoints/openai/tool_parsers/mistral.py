"""Mistral tool calls, after the `[TOOL_CALLS]` token: a JSON array of `{"name", "arguments"}` (tokenizers up to v7:
Mistral 7B v0.3, Nemo, Small 3) or `name[ARGS]{...}` per call (v11 on: Small 3.2, Magistral, Devstral; with
`[CALL_ID]id` before `[ARGS]` in some). Ids are 9 letters and digits, which Mistral's chat templates require."""
from __future__ import annotations

import random
import re
import string

from raylm.cluster.entrypoints.openai.tool_parsers.incremental import (
    IncrementalToolParser,
    PartialCall,
    Segment,
    rest_is_text,
)
from raylm.cluster.entrypoints.openai.tool_parsers.json_scan import (
    partial_suffix,
    scan_call_object,
    skip_whitespace,
    value_end,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(IncrementalToolParser):
    reads_special_tokens = True

    def new_call_id(self) -> str:
        return "".join(random.choices(_ID_ALPHABET, k=9))

    def parse(self, text: str, final: bool) -> list[Segment]:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return [text if final else text[: len(text) - partial_suffix(text, TOOL_CALLS)]]
        segments: list[Segment] = [text[:start]]
        position = skip_whitespace(text, start + len(TOOL_CALLS))
        if position == len(text):
            return segments if not final else [text]
        if text[position] == "[":
            return _array(text, start, position + 1, segments, final)
        while True:  # name[ARGS]{...}, each call after its own [TOOL_CALLS]
            name = _NAME.match(text, position)
            rest = text[name.end():] if name is not None else ""
            marker = ARGS if rest.startswith(ARGS) else CALL_ID if rest.startswith(CALL_ID) else None
            if name is None or marker is None:
                if not final and name is not None and (ARGS.startswith(rest) or CALL_ID.startswith(rest)):
                    return segments  # the name or its marker is still being written
                return rest_is_text(text, start, position, segments)
            arguments_start = name.end() + len(ARGS)
            if marker == CALL_ID:
                found = text.find(ARGS, name.end())
                if found < 0:
                    return segments if not final else rest_is_text(text, start, position, segments)
                arguments_start = found + len(ARGS)
            arguments_start = skip_whitespace(text, arguments_start)
            if arguments_start == len(text):
                segments.append(PartialCall(name.group(), ""))
                return segments
            end = value_end(text, arguments_start) if text[arguments_start] == "{" else arguments_start
            segments.append(PartialCall(name.group(), text[arguments_start: len(text) if end is None else end]))
            if end is None:
                return segments
            following = skip_whitespace(text, end)
            if not text.startswith(TOOL_CALLS, following):
                if not final and TOOL_CALLS.startswith(text[following:]):
                    return segments
                segments.append(text[end:])
                return segments
            position = skip_whitespace(text, following + len(TOOL_CALLS))


def _array(text: str, start: int, position: int, segments: list[Segment], final: bool) -> list[Segment]:
    """[{"name": ..., "arguments": ...}, ...]: calls as their objects are read."""
    while True:
        position = skip_whitespace(text, position)
        if position == len(text):
            return segments
        if text[position] == "]":
            segments.append(text[position + 1:])
            return segments
        call = scan_call_object(text, position) if text[position] == "{" else None
        if call is None or call.name is None:
            if call is not None and not call.invalid and call.end is None and not final:
                return segments
            return rest_is_text(text, start, position, segments)
        segments.append(PartialCall(call.name, call.arguments))
        if call.end is None:
            return segments
        position = skip_whitespace(text, call.end)
        if position < len(text) and text[position] == ",":
            position += 1
