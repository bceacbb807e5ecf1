"""How a chat or completions choice looks in a streamed chunk and in the
collected answer (answers.py's Shape), for plain text answers. Tool-calling
chat answers are tool_answers.py's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tandem.services.router.answers import Choice
from tandem.services.router.dispatch import Delta
from tandem.services.router.openai_protocol import LogprobFormatter


@dataclass
class ChatShape:
    formatter: LogprobFormatter
    logprobs: Optional[int]  # None: not asked for

    chunk_object = "chat.completion.chunk"
    final_object = "chat.completion"

    def opening(self, num_choices: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(num_choices)]

    def chunk_choice(self, index: int, delta: Delta, text_offset: int) -> Optional[dict]:
        lps = {"content": self.formatter.chat(delta.logprobs)} if self.logprobs is not None else None
        if not (delta.text or delta.finish_reason or lps):
            return None
        return {"index": index, "delta": {"content": delta.text} if delta.text else {}, "logprobs": lps,
                "finish_reason": delta.finish_reason}

    def final_choice(self, index: int, choice: Choice) -> dict:
        lps = {"content": self.formatter.chat(choice.logprobs)} if self.logprobs is not None else None
        return {"index": index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": lps, "finish_reason": choice.finish_reason}


@dataclass
class CompletionShape:
    formatter: LogprobFormatter
    logprobs: Optional[int]

    chunk_object = "text_completion"
    final_object = "text_completion"

    def opening(self, num_choices: int) -> list[dict]:
        return []

    def chunk_choice(self, index: int, delta: Delta, text_offset: int) -> Optional[dict]:
        lps = self.formatter.completion(delta.logprobs, text_offset) if self.logprobs is not None else None
        if not (delta.text or delta.finish_reason or lps):
            return None
        return {"index": index, "text": delta.text, "logprobs": lps, "finish_reason": delta.finish_reason}

    def final_choice(self, index: int, choice: Choice) -> dict:
        lps = self.formatter.completion(choice.logprobs, 0) if self.logprobs is not None else None
        return {"index": index, "text": choice.text, "logprobs": lps, "finish_reason": choice.finish_reason}
