"""GPT-OSS tool calls, in OpenAI's harmony format: messages `<|channel|>CHANNEL<|message|>TEXT<|end|>`, each after
the first opened by `<|start|>assistant`; a call is a message to `functions.NAME` (named in the channel header or
the role header) whose text is its JSON arguments, ended by `<|call|>`. The final channel, and commentary to no one
(a preamble), are content; the analysis channel is reasoning, never content."""
from __future__ import annotations

import re

from raylm.cluster.entrypoints.openai.tool_parsers.incremental import IncrementalToolParser, PartialCall, Segment
from raylm.cluster.entrypoints.openai.tool_parsers.json_scan import partial_suffix

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
START = "<|start|>"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class OpenAIToolParser(IncrementalToolParser):
    reads_special_tokens = True  # every harmony marker is a special token

    def parse(self, text: str, final: bool) -> list[Segment]:
        if not text.startswith("<|") and not (not final and "<|".startswith(text)):
            return [text]  # not harmony: plain text
        segments: list[Segment] = []
        position = 0
        while position < len(text):
            header_end = text.find(MESSAGE, position)
            if header_end < 0:
                break  # a header still being written
            header = text[position:header_end]
            body_start = header_end + len(MESSAGE)
            body_end, after = _message_end(text, body_start)
            body = text[body_start:body_end]
            if after is None and not final:
                body = body[: len(body) - max(partial_suffix(body, end) for end in (*ENDS, START))]
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if recipient is not None:
                segments.append(PartialCall(recipient.group(1), body))
            elif channel is None or channel.group(1) != "analysis":
                segments.append(body)
            if after is None:
                break
            position = after
        return segments


def _message_end(text: str, start: int) -> tuple[int, int | None]:
    """Where the message text from start ends, and where the next message starts (None: not ended yet)."""
    found = [(text.find(end, start), end) for end in (*ENDS, START)]
    ends = [(index, end) for index, end in found if index >= 0]
    if not ends:
        return len(text), None
    index, end = min(ends)
    return index, index + (0 if end == START else len(end))
