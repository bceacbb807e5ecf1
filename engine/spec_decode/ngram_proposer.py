"""Prompt lookup (n-gram) proposals: the last n tokens of a sequence, found
earlier in it (prompt or output), propose the tokens that followed them
there. An answer that quotes or edits its prompt, or repeats itself, is
predicted for free: no model runs.

The longest suffix is tried first (prompt_lookup_max down to
prompt_lookup_min), and of its earlier occurrences the latest: the nearest
context is the best guess of what comes next. A match close to the end is
copied on periodically, so a loop ("a b a b") is proposed k tokens ahead.

The search is bytes.rfind over the sequence's tokens as 32-bit integers:
one C call per suffix length, where the numpy passes it replaced cost a
dozen numpy calls per step whatever the batch. On the dev machine (2
cores), in the engine at batch 1, a lookup took 252 us through numpy
(57 us for the same inputs in a loop: the calls run cold between model
steps); timed in a loop, batch 1 went 57 -> 2 us and 64 sequences of 1,000
tokens 665 -> 172 us (docs/benchmarks.md, the thirty-first session).
"""
from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

if TYPE_CHECKING:
    from tandem.engine.request import Request

# Each token of the search buffer is one C int (array typecode "i"), 4 bytes
# wherever CPython runs: token ids are below 2^31.
TOKEN_BYTES = array("i").itemsize


def encode(tokens: Sequence[int]) -> bytes:
    """tokens as the search buffer's bytes (TOKEN_BYTES each)."""
    return array("i", tokens).tobytes()


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int,
                  buffer: Optional[bytes | bytearray] = None) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the
    longest suffix of tokens of length in [min_n, max_n]; [] when none
    occurs. buffer: encode(tokens), if the caller keeps it (else made here).

    A match found at a byte offset that is not a token boundary (the last
    bytes of one token and the first of the next spelling the needle) is
    not a token match: the search goes on to the left of it."""
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    if buffer is None:
        buffer = encode(tokens)
    # An earlier occurrence ends before the last token: within the first length - 1 tokens.
    searched = (length - 1) * TOKEN_BYTES
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        needle = buffer[(length - n) * TOKEN_BYTES:length * TOKEN_BYTES]
        end = searched
        while (at := buffer.rfind(needle, 0, end)) >= 0:
            if at % TOKEN_BYTES == 0:
                follow = at // TOKEN_BYTES + n  # the position after the match
                # Past the end, the copy goes on with what it copied `period` tokens earlier.
                period = length - follow
                return [tokens[follow + i % period] for i in range(k)]
            end = at + len(needle) - 1  # the next candidate starts left of this one
    return []


class NgramProposer:
    """A Proposer (speculator.py) without KV. Its one state: each request's
    search buffer, grown by the new tokens each step, since encoding a long
    sequence anew every step costs more than the search."""

    block_bytes = 0

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: dict[str, tuple["Request", bytearray]] = {}  # id -> (request, its search buffer)

    def bind(self, num_blocks: int, max_model_len: int, enable_caching: bool) -> None:
        pass

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._tokens.pop(request_id, None)

    def propose(self, requests: Sequence["Request"], num_tokens: Sequence[int]) -> list[list[int]]:
        return [propose_ngram(r.all_token_ids, self.min_n, self.max_n, k, self._buffer(r))
                for r, k in zip(requests, num_tokens)]

    def _buffer(self, request: "Request") -> bytearray:
        tokens = request.all_token_ids
        entry = self._tokens.get(request.request_id)
        encoded = len(entry[1]) // TOKEN_BYTES if entry is not None else 0
        # New, a new request under the same id, or (never expected) fewer tokens than encoded.
        if entry is None or entry[0] is not request or len(tokens) < encoded:
            buffer = bytearray(encode(tokens))
            self._tokens[request.request_id] = (request, buffer)
        else:
            buffer = entry[1]
            if len(tokens) > encoded:
                buffer += encode(tokens[encoded:])  # in place: the entry holds the same object
        return buffer
