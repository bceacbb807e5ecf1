"""The runner's persistent block-table rows: one numpy row per request that
holds blocks, kept across steps.

A request gets a row when it first appears in a plan; each later plan
appends the block ids its entry says the request got since; a plan that
names it in freed_request_ids (its blocks went back: finished, aborted,
preempted) drops the row before the plan's entries are read, so a request
that comes back starts a new row with all its blocks. Most decode steps
therefore write nothing, and a step where a request crosses into a new block
writes one id.

Invariant: after update(plan), row rows[i] holds the block ids of entry i's
request in its first lens[rows[i]] columns, and zeros past them.
"""
from __future__ import annotations

import numpy as np

from tandem.engine.plan import SchedulerOutput


class BlockTable:
    def __init__(self, num_rows: int = 8, width: int = 8) -> None:
        self.table = np.zeros((num_rows, width), dtype=np.int32)
        self.lens = np.zeros(num_rows, dtype=np.int64)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: low rows first

    @property
    def num_rows_used(self) -> int:
        return len(self._row_of)

    def update(self, plan: SchedulerOutput) -> np.ndarray:
        """Apply the plan's freed rows and new block ids; returns each entry's row."""
        row_of, table, lens = self._row_of, self.table, self.lens
        for request_id in plan.freed_request_ids:
            row = row_of.pop(request_id, None)
            if row is not None:
                table[row, : lens[row]] = 0
                lens[row] = 0
                self._free_rows.append(row)
        rows = []
        for request_id, new in zip(plan.request_ids, plan.new_block_ids):
            row = row_of.get(request_id)
            if row is None:
                if not self._free_rows:
                    self._grow(rows=2 * table.shape[0])
                    table, lens = self.table, self.lens
                row = row_of[request_id] = self._free_rows.pop()
            if new:
                start = int(lens[row])
                end = start + len(new)
                if end > table.shape[1]:
                    self._grow(width=2 * end)
                    table, lens = self.table, self.lens
                table[row, start:end] = new
                lens[row] = end
            rows.append(row)
        return np.array(rows, dtype=np.int64)

    def _grow(self, rows: int = 0, width: int = 0) -> None:
        old_rows, old_width = self.table.shape
        rows, width = max(rows, old_rows), max(width, old_width)
        table = np.zeros((rows, width), dtype=np.int32)
        table[:old_rows, :old_width] = self.table
        self.table = table
        lens = np.zeros(rows, dtype=np.int64)
        lens[:old_rows] = self.lens
        self.lens = lens
        self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)
