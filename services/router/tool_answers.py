"""A chat answer that may hold tool calls, streamed or whole.

Streaming: with tool_choice "auto" the text is sent as content while it is
plain text; from the first marker of a call on (`<tool_call>` for Hermes)
the rest is held back, and when the choice finishes it goes out as
`tool_calls` deltas (or as content, if it holds no call that parses). A
forced call (tool_choice "required" or named) sends nothing until it
finishes, then its calls. Either way a finished choice with calls has
finish_reason "tool_calls", as OpenAI's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tandem.services.router.answers import Choice
from tandem.services.router.dispatch import Delta
from tandem.services.router.shapes import ChatShape
from tandem.services.router.tool_calls import ToolCall, ToolCallParser, forced_calls


@dataclass
class _Held:
    text: str = ""  # everything so far
    sent: int = 0  # characters of it already sent as content
    holding: bool = False  # a call's marker was seen: nothing more goes out as content


@dataclass
class ToolChatShape(ChatShape):
    parser: Optional[ToolCallParser] = None  # None: the call is forced (tool_choice)
    tool_choice: object = None
    tool_names: set[str] = field(default_factory=set)
    parallel: bool = True  # False: one call at most (parallel_tool_calls)
    _held: dict[int, _Held] = field(default_factory=dict)

    def calls(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        if self.parser is None:
            try:
                return None, forced_calls(text, self.tool_choice)
            except (ValueError, KeyError, TypeError):
                # Cut short by max_tokens: the grammar did not finish, so the
                # partial JSON goes back as content with finish_reason "length".
                return text, []
        content, calls = self.parser.parse(text, self.tool_names)
        # A free answer may hold several calls; without parallel calls the
        # first is the answer (a forced call's grammar allows only one).
        return content, calls if self.parallel else calls[:1]

    def chunk_choice(self, index: int, delta: Delta, text_offset: int) -> Optional[dict]:
        held = self._held.setdefault(index, _Held())
        held.text += delta.text
        out: dict = {}
        if self.parser is not None and not held.holding:
            safe = self._plain_prefix(held)
            if safe > held.sent:
                out["content"] = held.text[held.sent:safe]
                held.sent = safe
        finish = delta.finish_reason
        if finish:
            content, calls = self.calls(held.text)
            if calls:
                out["tool_calls"] = [{"index": i, **c.body()} for i, c in enumerate(calls)]
                finish = "tool_calls" if finish == "stop" else finish
            elif len(held.text) > held.sent:
                out["content"] = out.get("content", "") + held.text[held.sent:]
            held.sent = len(held.text)
        lps = {"content": self.formatter.chat(delta.logprobs)} if self.logprobs is not None else None
        if not out and not finish and not lps:
            return None
        return {"index": index, "delta": out, "logprobs": lps, "finish_reason": finish}

    def _plain_prefix(self, held: _Held) -> int:
        """How much of the text is surely content: up to the first marker,
        less any tail that could be the start of one."""
        text = held.text
        first = min((i for i in (text.find(m) for m in self.parser.markers) if i >= 0), default=-1)
        if first >= 0:
            held.holding = True
            return first
        end = len(text)
        for marker in self.parser.markers:
            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:k]):
                    end = min(end, len(text) - k)
                    break
        return end

    def final_choice(self, index: int, choice: Choice) -> dict:
        body = super().final_choice(index, choice)
        content, calls = self.calls(choice.text)
        if calls:
            body["message"] = {"role": "assistant", "content": content,
                               "tool_calls": [c.body() for c in calls]}
            if choice.finish_reason == "stop":
                body["finish_reason"] = "tool_calls"
        return body
