"""When a waiting request may start: KV blocks kept for the output the
running requests are still expected to write.

Admitting a request whenever its prompt fits (vLLM's rule, `greedy` here)
fills the cache with prompts; as their answers grow the cache runs out, and
the newest running request is preempted and later recomputed from its first
token. On a GPU whose cache holds fewer tokens than max_num_seqs requests
reach (Llama-3-8B on an 80 GB H100 holds about 390k tokens against 1,024
requests of ~830), that recompute was about 127,000 of the 955,000 tokens
an offline run computed (docs/benchmarks.md, the thirty-third session).

`reserve` (the default) admits a request only while the free blocks cover
its own prompt and expected output plus what every running request is still
expected to write. A request's expected output is the mean output length of
recently finished requests, at most its max_tokens; until MIN_SAMPLES have
finished, its max_tokens up to PRIOR_TOKENS (a warm-up request of two
tokens would otherwise have every later request reserve two). An estimate,
not a promise: a request that outgrows it still takes blocks as it goes,
and preemption stays the fallback.
With nothing running, the head request is tried as before, so nothing waits
for ever.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from tandem.engine.request import Request

# The expected output of a request before any request has finished: chat
# answers are mostly shorter, and a client's own smaller max_tokens wins.
PRIOR_TOKENS = 1024
# Finished requests the mean is taken over: recent enough to follow a change
# of traffic, enough to be steady; and how many must have finished before
# their mean replaces the prior.
WINDOW = 128
MIN_SAMPLES = 16


class OutputLengthEstimate:
    """The expected number of output tokens of a request, from the output
    lengths of the last WINDOW requests that finished on their own (stop
    rules or max_tokens; aborted and failed ones say nothing)."""

    def __init__(self, prior_tokens: int = PRIOR_TOKENS, window: int = WINDOW,
                 min_samples: int = MIN_SAMPLES) -> None:
        self.prior_tokens = prior_tokens
        self.min_samples = min_samples
        self._recent: deque[int] = deque(maxlen=window)
        self._sum = 0

    def observe(self, num_output_tokens: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._sum -= self._recent[0]
        self._recent.append(num_output_tokens)
        self._sum += num_output_tokens

    def expected_tokens(self) -> int:
        """The expected output of a request with no max_tokens below it."""
        n = len(self._recent)
        return -(-self._sum // n) if n >= self.min_samples else self.prior_tokens

    def target_blocks(self, request: Request, block_size: int, max_model_len: int) -> int:
        """Blocks the request is expected to hold at its end: prompt plus
        expected output, within the model's context."""
        expected = self.expected_tokens()
        max_tokens = request.params.max_tokens
        tokens = request.num_prompt_tokens + (expected if max_tokens is None or max_tokens > expected
                                              else max_tokens)
        return -(-min(tokens, max_model_len) // block_size)

    def reserved_blocks(self, running: Iterable[Request], block_size: int, max_model_len: int) -> int:
        """Blocks the running requests are still expected to take: the rest
        of their prompts (chunked prefills) and of their expected outputs.
        target_blocks inline: this runs over every running request."""
        expected = self.expected_tokens()
        total = 0
        for request in running:
            max_tokens = request.params.max_tokens
            tokens = request.num_prompt_tokens + (expected if max_tokens is None or max_tokens > expected
                                                  else max_tokens)
            if tokens > max_model_len:
                tokens = max_model_len
            more = -(-tokens // block_size) - len(request.block_ids)
            if more > 0:
                total += more
        return total
