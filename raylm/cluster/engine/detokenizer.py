"""Incremental detokenization with stop-string detection.

Each update decodes only a short window of token ids: `tokens[prefix_offset:read_offset]` is text already
emitted, kept as left context because many decoders render a token differently at the start of a string
(a dropped leading space, a byte-level piece that needs its neighbours to form a character). The text of
`tokens[prefix_offset:]` minus that of `tokens[prefix_offset:read_offset]` is the new text.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens kept as left context for the first generated tokens.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
# A UTF-8 character has at most 4 bytes, so at most 3 byte-level tokens wait on its completion (more with
# special tokens in between). Text still incomplete after this many pending tokens is invalid UTF-8 from
# the model: emit it rather than let the decode window grow without bound.
_MAX_PENDING_TOKENS = 8
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns the generated token ids of one request into text, a few tokens at a time."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        token_texts: dict[int, str] | None = None,
    ) -> None:
        """`token_texts` memoizes the text of single tokens (with this tokenizer and skip_special_tokens), so it can
        be shared by the requests of one OutputProcessor."""
        self.tokenizer = tokenizer
        # The Rust tokenizer behind a fast tokenizer decodes the same text without transformers' per-call
        # Python overhead, which is most of the detokenizer's cost per token.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decode = (partial(backend.decode, skip_special_tokens=skip_special_tokens) if backend is not None
                  else partial(tokenizer.decode, skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=False))
        self._decode = cast(Callable[[list[int]], str], decode)  # transformers says str | list[str]; ids give a str
        self.skip_special_tokens = skip_special_tokens
        # Once streaming, the left context is the last emitted token: its text is looked up, not decoded again.
        self._token_texts: dict[int, str] = {} if token_texts is None else token_texts
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # Characters held back from streaming while a stop string might still be completing. When the stop
        # string is to be included anyway, a partial one may be streamed.
        self.stop_buffer_length = 0 if include_stop_str_in_output else max(self.max_stop_len - 1, 0)

        context = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:])
        self._token_ids = context
        self._num_context_tokens = len(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._output_text = ""
        self._last_output_text_offset = 0

    @property
    def output_text(self) -> str:
        return self._output_text

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens kept so far (tokens after the one completing a stop string are dropped)."""
        return self._token_ids[self._num_context_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self._num_context_tokens

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Appends tokens one by one; returns the stop string if one appears (the text is then truncated).

        `stop_terminated`: the last token is the stop token (EOS or one of stop_token_ids) that ended the request.
        As in vLLM, it is kept in the token ids but its text is left out, unless include_stop_str_in_output.
        """
        token_ids = self._token_ids
        skipped_stop_token_id = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            skipped_stop_token_id = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            token_ids.append(token_id)
            new_text = self._decode_next()
            if not new_text:
                continue
            self._output_text += new_text
            if self.stop:
                stop_str = self._check_stop_strings(len(new_text))
                if stop_str is not None:
                    return stop_str
        if skipped_stop_token_id is not None:
            token_ids.append(skipped_stop_token_id)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to stream: all of it, or (delta) only what was not returned before.

        Until the request finishes, the last `stop_buffer_length` characters are held back so that the
        start of a stop string is never streamed.
        """
        length = len(self._output_text) if finished else max(len(self._output_text) - self.stop_buffer_length, 0)
        if not delta:
            return self._output_text[:length]
        start = self._last_output_text_offset
        if start >= length:
            return ""
        self._last_output_text_offset = length
        return self._output_text[start:length]

    def _decode_next(self) -> str:
        token_ids, prefix_offset, read_offset = self._token_ids, self.prefix_offset, self.read_offset
        decode = self._decode
        if read_offset - prefix_offset == 1:
            token_id = token_ids[prefix_offset]
            prefix_text = self._token_texts.get(token_id)
            if prefix_text is None:
                prefix_text = self._token_texts[token_id] = decode([token_id])
        else:
            prefix_text = decode(token_ids[prefix_offset:read_offset])
        full_text = decode(token_ids[prefix_offset:])
        num_tokens = len(token_ids)
        if full_text.endswith(_REPLACEMENT_CHAR) and num_tokens - read_offset <= _MAX_PENDING_TOKENS:
            return ""
        if len(full_text) <= len(prefix_text):
            return ""
        self.prefix_offset = read_offset
        self.read_offset = num_tokens
        return full_text[len(prefix_text):]

    def _check_stop_strings(self, new_text_len: int) -> str | None:
        """Finds the earliest stop string ending in the new text; truncates the output text at it."""
        text = self._output_text
        # A stop string ending in the new text starts at most max_stop_len - 1 characters before it.
        search_start = max(len(text) - new_text_len - self.max_stop_len + 1, 0)
        best_index, best_stop = -1, None
        for stop_str in self.stop:
            index = text.find(stop_str, search_start)
            if index != -1 and (best_stop is None or index < best_index):
                best_index, best_stop = index, stop_str
        if best_stop is None:
            return None
        end = best_index + len(best_stop) if self.include_stop_str_in_output else best_index
        self._output_text = text[:end]
        return best_stop
