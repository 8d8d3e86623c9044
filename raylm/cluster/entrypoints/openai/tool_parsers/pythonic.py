"""Pythonic tool calls (Llama 3.2 / Llama 4, ToolACE): the answer is a Python list of calls with keyword arguments,
`[get_weather(city="Paris", unit="celsius"), get_time(zone=2)]`, optionally between `<|python_start|>` and
`<|python_end|>`. Arguments are Python literals, sent as JSON one argument at a time."""
from __future__ import annotations

import ast
import json
import re

from raylm.cluster.entrypoints.openai.tool_parsers.incremental import IncrementalToolParser, PartialCall, Segment
from raylm.cluster.entrypoints.openai.tool_parsers.json_scan import skip_whitespace, string_body_end

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.]*")
_CALL = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")  # how a list of calls starts


class PythonicToolParser(IncrementalToolParser):
    def parse(self, text: str, final: bool) -> list[Segment]:
        position = skip_whitespace(text, 0)
        if text.startswith(PYTHON_START, position):
            position = skip_whitespace(text, position + len(PYTHON_START))
        opening = _CALL.match(text, position)
        if opening is None:
            rest = text[position:]
            maybe = PYTHON_START.startswith(rest) or (rest.startswith("[") and re.fullmatch(r"\[\s*[\w.]*\s*", rest))
            return [] if not final and maybe else [text]
        segments: list[Segment] = []
        position += 1
        while True:
            position = skip_whitespace(text, position)
            name = _NAME.match(text, position)
            if name is None:
                return [*segments, text[position:]] if segments else [text]
            position = skip_whitespace(text, name.end())
            if position == len(text):
                return segments if segments or not final else [text]
            if text[position] != "(":
                return [*segments, text[name.start():]] if segments else [text]
            call = PartialCall(name.group(), "")
            segments.append(call)
            after = _arguments(text, position + 1, call)
            if after is None:
                return segments
            position = skip_whitespace(text, after)
            if position < len(text) and text[position] == ",":
                position += 1
                continue
            if position < len(text) and text[position] == "]":
                position = skip_whitespace(text, position + 1)
                if text.startswith(PYTHON_END, position):
                    position += len(PYTHON_END)
                return [*segments, text[position:]] if final or not PYTHON_END.startswith(text[position:]) else \
                    segments
            return segments if position == len(text) else [*segments, text[position:]]


def _arguments(text: str, position: int, call: PartialCall) -> int | None:
    """Reads `key=value, ...)` into call.arguments as JSON, each argument once its value is complete; the position
    after the closing parenthesis, or None while the call is still being written (or cannot be read on)."""
    pieces: list[str] = []
    while True:
        position = skip_whitespace(text, position)
        if position == len(text):
            return None
        if text[position] == ")":
            pieces.append("}" if pieces else "{}")
            call.arguments = "".join(pieces)
            return position + 1
        key = _NAME.match(text, position)
        equals = skip_whitespace(text, key.end()) if key is not None else position
        if key is None or equals == len(text) or text[equals] != "=":
            return None
        start = skip_whitespace(text, equals + 1)
        end = _python_value_end(text, start)
        if end is None:
            return None
        try:
            value = json.dumps(ast.literal_eval(text[start:end].strip()), ensure_ascii=False)
        except (ValueError, SyntaxError, TypeError, RecursionError):
            return None  # not a literal: the call stays unfinished (its arguments are not JSON)
        pieces.append(("{" if not pieces else ", ") + json.dumps(key.group()) + ": " + value)
        call.arguments = "".join(pieces)
        position = end + 1 if text[end] == "," else end


_PUNCTUATION = re.compile(r"[\"'()\[\]{},]")
# A string's characters up to its closing quote (or the end of the text): always matches, so never backtracks.
_STRINGS = {'"': re.compile(r'(?:[^"\\]+|\\.)*', re.DOTALL), "'": re.compile(r"(?:[^'\\]+|\\.)*", re.DOTALL)}


def _python_value_end(text: str, start: int) -> int | None:
    """Where the literal at text[start] ends: the top-level ',' or ')' after it; None until one is written. (By
    regular expressions: the stream re-reads the call on every delta.)"""
    depth, position = 0, start
    while True:
        found = _PUNCTUATION.search(text, position)
        if found is None:
            return None
        char, position = found.group(), found.start()
        if char in _STRINGS:
            position = string_body_end(_STRINGS[char], text, position + 1)
            if position == len(text):
                return None
            position += 1  # the closing quote
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return position if char == ")" else None
            depth -= 1
        elif depth == 0:  # a comma between arguments
            return position
        position += 1
