"""Prompt lookup (n-gram) proposals: the last n tokens of a sequence, found
earlier in it (prompt or output), propose the tokens that followed them
there. An answer that quotes or edits its prompt, or repeats itself, is
predicted for free: no model runs.

The longest suffix is tried first (prompt_lookup_max down to
prompt_lookup_min), and of its earlier occurrences the latest: the nearest
context is the best guess of what comes next. A match close to the end is
copied on periodically, so a loop ("a b a b") is proposed k tokens ahead.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    from tandem.engine.request import Request


def propose_ngram_batch(sequences: Sequence[np.ndarray], min_n: int, max_n: int,
                        ks: Sequence[int]) -> list[list[int]]:
    """Up to ks[i] tokens that followed the latest earlier occurrence of the
    longest suffix of sequences[i] (int64 arrays) of length in [min_n,
    max_n]; [] when none occurs. All sequences go through the same numpy
    passes over one concatenated array: a batch of 64 costs a few numpy
    calls, not 64 times as many."""
    n = len(sequences)
    if n == 0:
        return []
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=n)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    lasts = starts + lengths - 1  # each sequence's last position in `flat`
    flat = np.concatenate(sequences)
    owner = np.repeat(np.arange(n), lengths)
    # Candidates: earlier positions holding their sequence's last token (its
    # last position excluded). Each pass keeps those whose match with the
    # suffix goes one token further back, so the last survivors of a
    # sequence are its longest matches (up to max_n), the latest last.
    is_candidate = flat == np.repeat(flat[lasts], lengths)
    is_candidate[lasts] = False
    survivors = np.flatnonzero(is_candidate)
    follow = np.zeros(n, dtype=np.int64)  # where the latest longest match is followed, per sequence
    matched = np.zeros(n, dtype=np.int64)
    back = 0
    while survivors.size:
        owners = owner[survivors]
        # Survivors ascend, so the last of each owner's run is its latest.
        last_of_run = np.flatnonzero(np.diff(owners, append=-1))
        follow[owners[last_of_run]] = survivors[last_of_run] + 1
        matched[owners[last_of_run]] = back + 1
        back += 1
        if back >= max_n:
            break
        survivors = survivors[survivors - starts[owners] >= back]
        owners = owner[survivors]
        survivors = survivors[flat[survivors - back] == flat[lasts[owners] - back]]
    k_arr = np.asarray(ks, dtype=np.int64)
    hit = np.flatnonzero((matched >= min_n) & (k_arr > 0))
    out: list[list[int]] = [[] for _ in range(n)]
    if hit.size:
        # Position i after the match copies follow + i; a copy that runs into
        # the end goes on with what it copied `period` tokens earlier (as LZ77
        # copies overlap), so a repeated phrase is proposed k tokens ahead.
        period = lasts[hit] + 1 - follow[hit]
        steps = np.arange(int(k_arr[hit].max()))
        copied = flat[follow[hit][:, None] + steps[None, :] % period[:, None]].tolist()
        for i, row, k in zip(hit.tolist(), copied, k_arr[hit].tolist()):
            out[i] = row[:k]
    return out


class NgramProposer:
    """A Proposer (speculator.py) without KV. Its one state: each request's
    tokens as an int64 array, grown by the new tokens each step, since
    converting a long list anew every step costs more than the search."""

    block_bytes = 0

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: dict[str, tuple["Request", np.ndarray, int]] = {}  # id -> (request, buffer, length)

    def bind(self, num_blocks: int, max_model_len: int, enable_caching: bool) -> None:
        pass

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._tokens.pop(request_id, None)

    def propose(self, requests: Sequence["Request"], num_tokens: Sequence[int]) -> list[list[int]]:
        return propose_ngram_batch([self._array(r) for r in requests], self.min_n, self.max_n, num_tokens)

    def _array(self, request: "Request") -> np.ndarray:
        tokens = request.all_token_ids
        entry = self._tokens.get(request.request_id)
        if entry is None or entry[0] is not request:  # new, or a new request under the same id
            buffer, length = np.empty(2 * len(tokens) + 64, dtype=np.int64), 0
        else:
            _, buffer, length = entry
        if len(tokens) > len(buffer):
            grown = np.empty(2 * len(tokens), dtype=np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        buffer[length:len(tokens)] = tokens[length:]
        self._tokens[request.request_id] = (request, buffer, len(tokens))
        return buffer[:len(tokens)]
