"""DeepSeek V3 / R1 tool calls: after any text, one block of calls, each with its arguments in a json fence:
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>...
<｜tool▁calls▁end｜>` (the bars are U+FF5C, the spaces U+2581, as in DeepSeek's tokenizer)."""
from __future__ import annotations

from raylm.cluster.entrypoints.openai.tool_parsers.incremental import (
    IncrementalToolParser,
    PartialCall,
    Segment,
    rest_is_text,
)
from raylm.cluster.entrypoints.openai.tool_parsers.json_scan import partial_suffix, skip_whitespace, value_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(IncrementalToolParser):
    def parse(self, text: str, final: bool) -> list[Segment]:
        start = text.find(CALLS_BEGIN)
        if start < 0:
            return [text if final else text[: len(text) - partial_suffix(text, CALLS_BEGIN)]]
        segments: list[Segment] = [text[:start]]
        position = start + len(CALLS_BEGIN)
        while True:
            position = skip_whitespace(text, position)
            rest = text[position:]
            if rest.startswith(CALLS_END):
                return [*segments, text[position + len(CALLS_END):]]
            if not rest.startswith(CALL_BEGIN):
                if not final and (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
                    return segments
                return rest_is_text(text, start, position, segments)
            after = _call(text, position + len(CALL_BEGIN), segments, final)
            if after is None:
                return segments
            if after < 0:
                return rest_is_text(text, start, position, segments)
            position = after


def _call(text: str, position: int, segments: list[Segment], final: bool) -> int | None:
    """`function<sep>NAME\\n```json\\n{...}\\n```<call end>` at position: appends the call once its name is known;
    the position after it, None while it is being written, or -1 where it is not a call."""
    sep = text.find(SEP, position)
    if sep < 0:
        return None if not final and f"function{SEP}".startswith(text[position:].lstrip()) else -1
    newline = text.find("\n", sep)
    if text[position:sep].strip() != "function" or (newline < 0 and final):
        return -1
    if newline < 0:
        return None  # the name is still being written
    name = text[sep + len(SEP): newline].strip()
    if not name:
        return -1
    call = PartialCall(name, "")
    segments.append(call)
    arguments_start = text.find("{", newline)  # after the ```json line
    if arguments_start < 0:
        return None if not final else len(text)
    end = value_end(text, arguments_start)
    call.arguments = text[arguments_start: len(text) if end is None else end]
    if end is None:
        return None
    close = text.find(CALL_END, end)
    return None if close < 0 else close + len(CALL_END)
