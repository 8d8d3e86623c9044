"""GPT-OSS's reasoning parser (vLLM's `openai_gptoss`), on OpenAI's harmony format: the output is messages
`<|channel|>CHANNEL<|message|>TEXT<|end|>`, each after the first opened by `<|start|>assistant`. The analysis channel
is the reasoning; the final channel's text is the content. A message to a recipient (`to=functions.NAME`, a tool
call) or on another channel (commentary: a preamble before a call) stays in the content as harmony text, header and
end marker included, for the `openai` tool parser to read; so does every message after one of those, which that
parser then reads in order. Output that does not start with a harmony marker is all content.

The markers are special tokens (so the server keeps them in the text: reads_special_tokens) and arrive whole, never
split between two deltas; a header's words (`analysis`, `to=...`) may be split, so a header is held until its
`<|message|>` arrives.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raylm.cluster.core.reasoning.think_parser import ReasoningParser, ReasoningStream

NAME = "openai_gptoss"
CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class HarmonyReasoningParser(ReasoningParser):
    """The think parser's interface (is_reasoning_end, extract_reasoning, stream) over harmony messages."""

    reads_special_tokens = True

    def __init__(self, tokenizer: Any) -> None:  # not super().__init__: it looks for <think> markers
        self.name, self.tokenizer = NAME, tokenizer
        vocab = tokenizer.get_vocab()
        missing = [marker for marker in (CHANNEL, MESSAGE, START, *ENDS) if marker not in vocab]
        if missing:
            raise ValueError(f"reasoning_parser {NAME}: the tokenizer has no single token for {missing} (GPT-OSS's "
                             f"harmony markers)")
        self.channel_id, self.message_id, self.start_id = vocab[CHANNEL], vocab[MESSAGE], vocab[START]
        self.end_ids = {vocab[end] for end in ENDS}

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the last message whose text has begun is on a channel other than analysis (a new header still
        being written, as at the end of a prompt's `<|start|>assistant`, has not ended the reasoning)."""
        for index in range(len(token_ids) - 1, -1, -1):
            token_id = token_ids[index]
            if token_id in (self.start_id, self.channel_id):
                return False  # a header after the last message's text
            if token_id == self.message_id:
                return self._channel_before(token_ids, index) not in (None, "analysis")
        return False

    def _channel_before(self, token_ids: Sequence[int], message_index: int) -> str | None:
        """The channel named in the header that ends at message_index (None: it names none, a user's message)."""
        for index in range(message_index - 1, -1, -1):
            token_id = token_ids[index]
            if token_id == self.channel_id:
                words = self.tokenizer.decode(list(token_ids[index + 1:message_index])).split()
                return words[0] if words else ""
            if token_id == self.start_id or token_id in self.end_ids:
                return None
        return None

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = HarmonyStream().feed(text)
        return reasoning or None, content or None

    def stream(self) -> HarmonyStream:
        return HarmonyStream()


@dataclass
class HarmonyStream(ReasoningStream):
    """Splits streamed text deltas message by message: `position` is where the message being read starts,
    `emitted` how much of it has been sent."""

    in_reasoning: bool = True
    text: str = ""
    plain: bool | None = None  # not harmony: all content (None: too little text to tell)
    raw: bool = False  # a message stayed harmony text: every later one does too
    position: int = 0
    emitted: int = 0

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        if self.plain is None:
            if self.text.startswith("<|"):
                self.plain = False
            elif "<|".startswith(self.text):
                return "", ""
            else:
                self.plain = True
                delta = self.text
        if self.plain:
            return "", delta
        reasoning, content = [], []
        while True:
            header_end = self.text.find(MESSAGE, self.position)
            if header_end < 0:
                break  # a header still being written
            header = self.text[self.position:header_end]
            body_start = header_end + len(MESSAGE)
            body_end, after = _message_end(self.text, body_start)
            channel = _CHANNEL_NAME.search(header)
            name = channel.group(1) if channel is not None else None
            if "to=" not in header and name == "analysis":
                reasoning.append(self.text[body_start + self.emitted:body_end])
                self.emitted = body_end - body_start
            elif "to=" not in header and name == "final" and not self.raw:
                content.append(self.text[body_start + self.emitted:body_end])
                self.emitted = body_end - body_start
            else:  # a call, a preamble: the whole message as harmony text
                self.raw = True
                end = len(self.text) if after is None else after
                content.append(self.text[self.position + self.emitted:end])
                self.emitted = end - self.position
            if after is None:
                break
            self.position, self.emitted = after, 0
        return "".join(reasoning), "".join(content)


def _message_end(text: str, start: int) -> tuple[int, int | None]:
    """Where the message text from start ends, and where the next message starts (None: not ended yet)."""
    found = [(index, end) for end in (*ENDS, START) if (index := text.find(end, start)) >= 0]
    if not found:
        return len(text), None
    index, end = min(found)
    return index, index + (0 if end == START else len(end))
