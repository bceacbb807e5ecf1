"""Incremental detokenization with stop strings.

Text is emitted in deltas. A delta never ends inside a UTF-8 character
(a trailing U+FFFD waits for the next token) nor inside what could still
become a stop string (the last len(longest stop) - 1 characters wait).
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

    def _decode(self) -> str:
        return self.tokenizer.decode(self.output_ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> Optional[str]:
        """Add tokens; returns the stop string if one appeared (text is cut there)."""
        if self.tokenizer is None:
            return None
        before = len(self.text)
        self.output_ids.extend(token_ids)
        self.text = self._decode()
        if not self.stop:
            return None
        # Only a window that includes the new characters can hold a new match.
        search_from = max(0, before - self.holdback - 1)
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1:
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                return s
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
