"""Incremental detokenization with stop strings.

Text is emitted in deltas. A delta never ends inside a UTF-8 character
(a trailing U+FFFD waits for the next token) nor inside what could still
become a stop string (the last len(longest stop) - 1 characters wait).

The text always equals `tokenizer.decode(output_ids, skip_special_tokens=True)`
(what a client would get by decoding the ids itself), cut at a stop string.
With a fast (Rust) tokenizer each token costs the same however long the
output: tokenizers' DecodeStream turns ids into text as they come and holds
back the bytes of an unfinished character; at the end the rest of the full
decode is appended once. Other tokenizers re-decode the whole output per
token (quadratic in the output's length).
"""
from __future__ import annotations

from typing import Any, Optional

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: list[str], include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of `text` already handed out
        self.output_ids: list[int] = []
        self.stopped = False  # a stop string cut the text: nothing more is added
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=True)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.output_ids, skip_special_tokens=True)

    def add(self, token_id: int) -> Optional[str]:
        """Add one token; returns the stop string if one appeared (text is cut there)."""
        if self.tokenizer is None or self.stopped:
            return None
        before = len(self.text)
        self.output_ids.append(token_id)
        if self._stream is None:
            self.text = self._decode()
        else:
            chunk = self._stream.step(self._backend, token_id)
            if chunk:
                self.text += chunk
        return self._find_stop(before)

    def _find_stop(self, before: int) -> Optional[str]:
        if not self.stop:
            return None
        # Only a window that includes the new characters can hold a new match.
        search_from = max(0, before - self.holdback - 1)
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1:
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                self.stopped = True
                return s
        return None

    def finish(self) -> Optional[str]:
        """The request ends: the bytes the stream still holds (an unfinished
        character, decoded as U+FFFD as the full decode does) join the text.
        Returns a stop string they completed, if any."""
        if self.tokenizer is None or self.stopped or self._stream is None:
            return None
        full = self._decode()  # once per request
        if len(full) > len(self.text) and full.startswith(self.text):
            before = len(self.text)
            self.text = full
            return self._find_stop(before)
        return None

    def delta(self, finished: bool) -> str:
        end = len(self.text)
        if not finished:
            end = len(self.text.rstrip(REPLACEMENT))
            end = min(end, len(self.text) - self.holdback) if self.holdback else end
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
