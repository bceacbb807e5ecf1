"""The batch's block tables as one numpy array that lives across steps.

Row i holds the block ids of the i-th scheduled request, zero-padded. A
request's block list (KVCacheManager.block_ids) only ever grows by appending
while the request holds its blocks; freeing drops the list and a later
allocation starts a new one. So a row is still right when it was written from
the same list object and that list has not grown: most decode steps rewrite
nothing, and a step where a request crosses into a new block writes one id.

Invariant: after update(), table[:n, :width] equals the from-scratch build
(row i = block_ids of request i, then zeros), and the columns up to the widest
row ever written are zero past each row's length.
"""
from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, num_rows: int = 8, width: int = 8) -> None:
        self.table = np.zeros((num_rows, width), dtype=np.int32)
        # The list each row was written from (kept alive, so `is` cannot be fooled
        # by a recycled id) and how many of its ids the row holds.
        self._lists: list[list[int] | None] = [None] * num_rows
        self._lens = [0] * num_rows

    def update(self, block_ids: list[list[int]]) -> np.ndarray:
        """Bring rows 0..n-1 up to date with these lists; returns the [n, width] view
        (width: the longest list). The view is overwritten by the next update."""
        n = len(block_ids)
        width = max(map(len, block_ids), default=0)
        if n > self.table.shape[0] or width > self.table.shape[1]:
            self._grow(n, width)
        table, lists, lens = self.table, self._lists, self._lens
        for i, ids in enumerate(block_ids):
            old = lens[i]
            new = len(ids)
            if lists[i] is ids and new >= old:
                if new == old:
                    continue
                table[i, old:new] = ids[old:]  # blocks appended since the last step
            else:
                lists[i] = ids
                table[i, :new] = ids
                if old > new:
                    table[i, new:old] = 0
            lens[i] = new
        return table[:n, :width]

    def _grow(self, n: int, width: int) -> None:
        rows, cols = self.table.shape
        if n > rows:
            rows = 2 * n
        if width > cols:
            cols = 2 * width
        table = np.zeros((rows, cols), dtype=np.int32)
        table[: self.table.shape[0], : self.table.shape[1]] = self.table
        self.table = table
        extra = rows - len(self._lists)
        self._lists.extend([None] * extra)
        self._lens.extend([0] * extra)
