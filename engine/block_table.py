"""The runner's block tables, kept across steps: row i holds the block ids of
the plan's entry i.

The runner keeps its own copy of each request's block ids, built from the
plans alone: a request's first entry carries all its blocks, each later one
the blocks it got since (usually none), and a plan's freed_request_ids
(finished, aborted, preempted) drop the copy before its entries are read, so
a request that comes back starts over with all its blocks. A row is
rewritten only when another request's entry lands on it (a request ahead of
it finished, or joined); otherwise a step appends the new ids, if any. In a
steady decode batch most steps write nothing.

Invariant: after update(plan), table[:n, :width] holds, in row i, the block
ids of entry i's request followed by zeros (n entries, width the longest).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from tandem.engine.plan import SchedulerOutput


class BlockTable:
    def __init__(self, num_rows: int = 8, width: int = 8) -> None:
        self.table = np.zeros((num_rows, width), dtype=np.int32)
        self._block_ids: dict[str, list[int]] = {}  # each request's block ids, from the plans
        self._row_owner: list[Optional[str]] = [None] * num_rows  # whose blocks row i holds
        self._row_len = [0] * num_rows
        self._row_of: dict[str, int] = {}  # the row a request's blocks were last written to

    @property
    def num_requests(self) -> int:
        return len(self._block_ids)

    def update(self, plan: SchedulerOutput) -> np.ndarray:
        """Apply the plan; returns the [n, width] table of its entries (a view,
        overwritten by the next update)."""
        owner, row_len, known = self._row_owner, self._row_len, self._block_ids
        for request_id in plan.freed_request_ids:
            known.pop(request_id, None)
            row = self._row_of.pop(request_id, None)
            if row is not None and owner[row] is request_id:
                owner[row] = None  # a new request under the same id must not match this row
        n = len(plan.request_ids)
        if n > len(owner):
            self._grow(rows=2 * n)
            owner, row_len = self._row_owner, self._row_len
        table = self.table
        for i, (request_id, new) in enumerate(zip(plan.request_ids, plan.new_block_ids)):
            if owner[i] is request_id:
                if new:  # the common change: a decode that crossed into a new block
                    ids = known[request_id]
                    start = len(ids)
                    ids.extend(new)
                    if len(ids) > table.shape[1]:
                        table = self._grow(width=2 * len(ids))
                    table[i, start:len(ids)] = new
                    row_len[i] = len(ids)
                continue
            ids = known.get(request_id)
            if ids is None:
                ids = known[request_id] = list(new)  # a new (or resumed) request: all its blocks
            elif new:
                ids.extend(new)
            if len(ids) > table.shape[1]:
                table = self._grow(width=2 * len(ids))
            table[i, : len(ids)] = ids
            if row_len[i] > len(ids):
                table[i, len(ids): row_len[i]] = 0
            previous = self._row_of.get(request_id)
            if previous is not None and previous != i and owner[previous] is request_id:
                owner[previous] = None  # a request owns one row at most: its current one
            owner[i], row_len[i] = request_id, len(ids)
            self._row_of[request_id] = i
        return table[:n, : max(row_len[:n], default=0)]

    def _grow(self, rows: int = 0, width: int = 0) -> np.ndarray:
        old_rows, old_width = self.table.shape
        rows, width = max(rows, old_rows), max(width, old_width)
        table = np.zeros((rows, width), dtype=np.int32)
        table[:old_rows, :old_width] = self.table
        self.table = table
        self._row_owner.extend([None] * (rows - old_rows))
        self._row_len.extend([0] * (rows - old_rows))
        return table
