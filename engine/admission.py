"""When a waiting request may start: KV blocks kept for the output the
running requests are still expected to write.

Admitting a request whenever its prompt fits (vLLM's rule, `greedy` here)
fills the cache with prompts; as their answers grow the cache runs out, and
the newest running request is preempted and later recomputed from its first
token. On a GPU whose cache holds fewer tokens than max_num_seqs requests
reach (Llama-3-8B on an 80 GB H100 holds about 390k tokens against 1,024
requests of ~830), that recompute was about 127,000 of the 955,000 tokens
an offline run computed (docs/benchmarks.md, the thirty-third session).

`reserve` (the default) projects the blocks the running requests will hold
step by step until each is expected to finish (every one grows a token a
step, then lets all its blocks go) and admits a request only while that
projection, with the request in it, stays within the cache. Blocks that
requests finishing soon give back thus serve the growth of those that
finish later, where reserving every request's whole output at once would
keep a newcomer waiting. The price is smaller batches than greedy's
overcommitted ones: in that offline workload, replayed through this
scheduler without a model (`tandem bench admission-replay`), 731 decode
steps of 330 sequences against 487 of 489, and no token computed twice.

A request's expected output is the mean output length of recently finished
requests, at most its max_tokens; until MIN_SAMPLES have finished, its
max_tokens up to PRIOR_TOKENS (a warm-up request of two tokens would
otherwise have every later request expect two). An estimate, not a promise:
a request that outgrows it still takes blocks as it goes, and preemption
stays the fallback. With nothing running, the head request is tried as
before, so nothing waits for ever.

`--admission-overcommit` lets the projection exceed the cache by a share
of it (0 by default). Holding back every request that could overflow the
cache computes nothing twice but, when a burst arrives at once, leaves the
last requests of the burst to run after the rest, in small batches that
each still read all the weights; a small overshoot costs a few preemptions
instead. On an H100 (docs/benchmarks.md, the thirty-fourth session) exact
reserve beat greedy by 7% on an offline burst with a bf16 cache, and lost
to it by 2.5% with an FP8 cache, which holds twice the tokens, so that
greedy overshot by 8% only and preempted 41 requests.

A short tail is admitted past the projection (`--admission-tail`, 0.1 by
default): where the projection turns a request away but every request still
waiting, it included, would fit in that share of the cache at its expected
end, they are admitted up to that much more. Held back, such a tail would
decode alone once the rest finish, each of its steps reading all the weights;
admitted, it costs at most a few preemptions. A longer queue waits as
before: it will fill batches of its own. Replayed (`tandem bench
admission-replay`), the rule makes, step for step, the plan that measured
fastest on the H100 for both offline bursts timed there: exact reserve's for
Llama-3-8B over a bf16 cache (527 requests waiting: no tail), greedy's over
an FP8 cache (54 waiting, 5.7% of it). For Qwen3-30B-A3B, whose cache bounds
the batch all along, it replays as exact reserve (untimed; greedy only adds
recompute there).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterable

import numpy as np

if TYPE_CHECKING:
    from tandem.engine.request import Request

# The expected output of a request before enough requests have finished:
# chat answers are mostly shorter, and a client's own smaller max_tokens wins.
PRIOR_TOKENS = 1024
# Finished requests the mean is taken over: recent enough to follow a change
# of traffic, enough to be steady; and how many must have finished before
# their mean replaces the prior.
WINDOW = 128
MIN_SAMPLES = 16
# How far the projected blocks may exceed the cache, as a share of it, by
# default: none. Replayed (`tandem bench admission-replay`), 0.1 admits that
# FP8-cache burst as greedy does, and the bf16 one in decode batches of 479
# against 330 for 38k tokens computed twice (greedy: 127k); but where the
# cache, not a burst, bounds the batch all along (Qwen3-30B-A3B's 111k-token
# cache) it only adds 26k tokens computed twice to the same 1,027 steps.
DEFAULT_OVERCOMMIT = 0.0
# The share of the cache a waiting queue may reach, all of it at its expected
# end, and still be admitted past the projection as one short tail. 0.06 and
# 0.1 replay alike on the three bursts of docs/benchmarks.md (the
# thirty-sixth session); 0.1 is also the overcommit that tied exact reserve
# on the H100 where a tail is not the question (a bf16 cache, the
# thirty-fourth session).
DEFAULT_TAIL = 0.1


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

    def expected_output(self, request: Request) -> int:
        expected = self.expected_tokens()
        max_tokens = request.params.max_tokens
        return expected if max_tokens is None or max_tokens > expected else max_tokens


def tail_fits(waiting: Iterable[Request], estimate: OutputLengthEstimate, limit_tokens: float) -> bool:
    """Whether the waiting requests' tokens at their expected ends (prompt and
    output so far, plus what each is still expected to write) sum to at most
    limit_tokens; stops counting once past it (a long queue costs little)."""
    total = 0
    for request in waiting:
        total += request.num_tokens + max(estimate.expected_output(request) - request.num_output_tokens, 0)
        if total > limit_tokens:
            return False
    return True


def steps_left(request: Request, expected_output: int) -> int:
    """Decode steps until the request is expected to finish: at least one
    (a request past its estimate may finish at any step)."""
    left = expected_output - request.num_output_tokens
    return left if left > 1 else 1


class KVProjection:
    """The blocks the running requests are expected to hold at each future
    step. A request of n tokens now (its whole prompt, if a chunk of it is
    still to come) finishing in f steps holds ceil((n + t) / block_size)
    blocks at step t <= f, at most (n + t) / block_size + 1, and none after.
    Between two finishes the total only grows, so its peaks lie at the
    finishing steps: the projection keeps those, sorted, with each request's
    tokens now, and a request is admitted while the peaks up to its own
    finish, with it added, stay within the capacity (the free blocks plus
    those the running requests hold, and the overcommit allowed beyond)."""

    def __init__(self, running: Iterable[Request], estimate: OutputLengthEstimate, block_size: int,
                 capacity: float) -> None:
        self.block_size = block_size
        self.capacity = capacity
        expected = estimate.expected_tokens()
        finish, tokens = [], []
        # expected_output and steps_left inline: this loop runs over every running
        # request each plan that admits. On the dev CPU at 1,024 running the whole
        # projection took 0.27 ms, the two calls a request alone 0.29 ms.
        for request in running:
            max_tokens = request.params.max_tokens
            out = expected if max_tokens is None or max_tokens > expected else max_tokens
            left = out - request.num_output_tokens
            finish.append(left if left > 1 else 1)
            tokens.append(request.num_prompt_tokens + request.num_output_tokens)
        order = np.argsort(np.asarray(finish, dtype=np.float64), kind="stable")
        self.finish = np.asarray(finish, dtype=np.float64)[order]
        self.tokens = np.asarray(tokens, dtype=np.float64)[order]

    def peak(self, finish: np.ndarray, tokens: np.ndarray, upto: int) -> float:
        """The most blocks held at the finishing steps finish[:upto] (upto >= 1)."""
        alive_tokens = np.cumsum(tokens[::-1])[::-1][:upto]  # tokens now of those still running at each
        alive = np.arange(len(finish), len(finish) - upto, -1, dtype=np.float64)
        return float(((alive_tokens + alive * finish[:upto]) / self.block_size + alive).max())

    def admit(self, tokens: int, finish: int) -> bool:
        """Whether a request that will hold `tokens` tokens in new blocks once
        its prompt is in, expected to finish in `finish` steps, keeps the
        projection within the capacity; if so it joins the projection."""
        i = int(np.searchsorted(self.finish, finish, side="right"))
        times = np.insert(self.finish, i, float(finish))
        held = np.insert(self.tokens, i, float(tokens))
        if self.peak(times, held, i + 1) > self.capacity:
            return False
        self.finish, self.tokens = times, held
        return True
