"""Reading JSON that is still being written: where a value ends (or that it has not ended yet), and a call object's
name and arguments text so far, so that arguments stream as the model writes them."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WHITESPACE = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")  # hermes / mistral say arguments, Llama 3 parameters


class NotJson(ValueError):
    """The text cannot be the JSON value expected there."""


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in _WHITESPACE:
        position += 1
    return position


def value_end(text: str, start: int) -> int | None:
    """The end (exclusive) of the JSON value at text[start], or None while it is incomplete. A scalar ends at the
    first delimiter, so one at the very end of the text counts as incomplete (more digits may follow). The stream
    re-reads a call on every delta, so the scanning is done by regular expressions (C), not a loop per character."""
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first not in "{[":
        if first not in "-0123456789tfn":
            raise NotJson(f"no JSON value starts with {first!r}")
        delimiter = _SCALAR_END.search(text, start)
        return delimiter.start() if delimiter is not None else None
    depth, position = 0, start
    while True:
        found = _STRUCTURE.search(text, position)
        if found is None:
            return None
        char, position = found.group(), found.start()
        if char == '"':
            end = _string_end(text, position)
            if end is None:
                return None
            position = end
            continue
        depth += 1 if char in "{[" else -1
        position += 1
        if depth == 0:
            return position


# A string's characters up to its closing quote (or the end of the text): always matches, so never backtracks.
_STRING_BODY = re.compile(r'(?:[^"\\]+|\\.)*', re.DOTALL)
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[,}\]\s]")


def _string_end(text: str, start: int) -> int | None:
    end = string_body_end(_STRING_BODY, text, start + 1)
    return end + 1 if end < len(text) and text[end] == '"' else None


def string_body_end(body: re.Pattern[str], text: str, start: int) -> int:
    match = body.match(text, start)
    assert match is not None, "the pattern matches the empty string"
    return match.end()


@dataclass
class CallObject:
    """A {"name": ..., "arguments": {...}} object read so far."""

    name: str | None = None
    arguments: str = ""  # the arguments value's text so far ("{}" once the object closes without one)
    end: int | None = None  # where the object ends, once it has
    invalid: bool = False  # the text stopped being a call object (what was read before stays)


def scan_call_object(text: str, start: int) -> CallObject:
    """Reads the object at text[start] as far as the text goes."""
    call = CallObject()
    try:
        _scan(text, start, call)
    except ValueError:  # NotJson, or a key that is not a JSON string
        call.invalid = True
    return call


def _scan(text: str, start: int, call: CallObject) -> None:
    if text[start] != "{":
        raise NotJson("a call is a JSON object")
    position = skip_whitespace(text, start + 1)
    while position < len(text):
        if text[position] == "}":
            call.arguments = call.arguments or "{}"
            call.end = position + 1
            return
        if text[position] != '"':
            raise NotJson("expected a key")
        key_end = _string_end(text, position)
        if key_end is None:
            return
        key = json.loads(text[position:key_end])
        position = skip_whitespace(text, key_end)
        if position == len(text):
            return
        if text[position] != ":":
            raise NotJson("expected ':' after a key")
        position = skip_whitespace(text, position + 1)
        if position == len(text):
            return
        end = value_end(text, position)
        if key in ARGUMENT_KEYS and not call.arguments:
            call.arguments = text[position: end if end is not None else len(text)]
        if end is None:
            return
        if key == "name":
            name = json.loads(text[position:end])
            if not isinstance(name, str):
                raise NotJson("the name is not a string")
            call.name = name
        position = skip_whitespace(text, end)
        if position < len(text) and text[position] == ",":
            position = skip_whitespace(text, position + 1)
        elif position < len(text) and text[position] != "}":
            raise NotJson("expected ',' or '}' after a value")


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that starts the marker (it may complete in the next delta)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
