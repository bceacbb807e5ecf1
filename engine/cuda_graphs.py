"""CUDA graphs for decode steps (thesis 4.6): one graph per batch size bucket.

A decode-only step's launches are captured once per bucket and replayed with
the step's inputs copied into persistent buffers. Padding rows carry slot -1
(no K/V write) and context length 0 (the attention kernels return zeros for
them), so one graph serves every batch up to its bucket. The attention grid
is sized for the longest context the engine allows, a bound fixed at capture.

Speculative decoding's verifying steps get graphs of their own (query_len =
1 + k): q rows per sequence, each sequence's rows the last q tokens of its
context. A sequence with fewer draft tokens has its rows first and padding
rows after them (slot -1, junk outputs no row reads: causal attention keeps
them from every real row), its context length counted with the padding;
padding sequences get context q over whatever their table rows hold.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from tandem.kernels import AttentionMetadata
from tandem.engine.tensor_parallel import tp_group

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while graphs are captured: one can destroy
    another, unreachable CUDA graph (an earlier engine's in the same
    process), and destroying a graph is not allowed while a stream
    captures: the capture fails."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture(run: Callable[[], Any], pool) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(the CUDA graph of run(), what run() returned in the capture: its
    output tensors, which each replay rewrites). Warmed up first, so that
    Triton compiles and autotunes outside the capture, and replayed once,
    since a graph's first launch uploads it to the device at a far higher
    host cost than a replay: here, not in a served step. Its inputs then are
    the warm-up's."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    # Under tensor parallelism NCCL's watchdog thread polls the events of
    # earlier collectives while this thread captures: "global" would count
    # those calls against the capture.
    mode = "thread_local" if tp_group().world_size > 1 else "global"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
        output = run()
    graph.replay()
    return graph, output


def verify_buckets(max_batch: int, query_len: int, max_rows: int) -> list[int]:
    """Batch sizes of the verifying graphs: as the decode ones, none of more
    rows than a step may compute (the token budget)."""
    return [b for b in BUCKETS if b <= max_batch and b * query_len <= max_rows] or [1]


def padded_rows(q_lens: np.ndarray, query_len: int) -> np.ndarray:
    """Where each of a verifying batch's rows (entry after entry, q_lens[i]
    rows of entry i) goes in the graph's layout of query_len rows an entry."""
    starts = np.cumsum(q_lens) - q_lens
    return np.repeat(np.arange(len(q_lens)) * query_len - starts, q_lens) + np.arange(int(q_lens.sum()))


@dataclass
class GraphOutput:
    """A replay's hidden states: every row of its bucket, padding included,
    so that what is computed from them next (the LM head) has the bucket's
    fixed shape; and which of those rows are the batch's."""

    padded: torch.Tensor
    n: int  # the batch's rows are the first n ...
    rows: Optional[torch.Tensor] = None  # ... or these (a verifying batch in the graph's layout)

    def select(self, t: torch.Tensor) -> torch.Tensor:
        """The batch's rows of t (rows in the bucket's order), in the batch's order."""
        return t[: self.n] if self.rows is None else t[self.rows]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_batch: int,
                 max_model_len: int, block_size: int, device: torch.device, query_len: int = 1,
                 sizes: Optional[list[int]] = None) -> None:
        """query_len: rows a sequence (1: decode steps; 1 + k: verifying steps)."""
        self.model = model
        self.kv_caches = kv_caches
        self.query_len = q = query_len
        self.sizes = sizes or [b for b in BUCKETS if b <= max_batch] or [1]
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n * q, dtype=torch.long, device=device)
        self.positions = torch.zeros(n * q, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n * q,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=device)
        # Decode padding has context 0 (zeros out); a verifying graph's padding sequences
        # see q tokens, so their rows (and the prefill kernel's sums) stay finite.
        self.seq_lens = torch.full((n,), 0 if q == 1 else q, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.padded_replays = 0  # verifying batches with entries of fewer rows than the graph's
        self._capture_all()

    def _meta(self, b: int) -> AttentionMetadata:
        q = self.query_len
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: b * q], query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], max_query_len=q,
            max_seq_len=self.max_model_len, uniform_queries=q > 1)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with gc_paused():
            pool = torch.cuda.graph_pool_handle()
            q = self.query_len
            for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
                args = (self.input_ids[: b * q], self.positions[: b * q], self.kv_caches, self._meta(b))
                self.graphs[b], self.outputs[b] = capture(lambda args=args: self.model(*args), pool)
            torch.cuda.synchronize()
        log.info("captured %s CUDA graphs for batch sizes %s",
                 "decode" if q == 1 else f"verifying ({q} rows a sequence)", self.sizes)

    def release(self) -> None:
        """Free every graph. Under tensor parallelism this must come before
        the process group is destroyed: NCCL's communicator destroy waits for
        ever while a captured graph that holds its collectives is alive
        (pytorch/pytorch#115388)."""
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def bucket(self, num_seqs: int) -> Optional[int]:
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> GraphOutput:
        """Hidden states of a decode-only batch (one token per sequence)."""
        n = input_ids.shape[0]
        b = self.bucket(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if b > n:  # padding rows: no write, no context
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(0)
        self.graphs[b].replay()
        self.replays += 1
        return GraphOutput(self.outputs[b], n)

    def fits_verify(self, q_lens: np.ndarray, num_computed: np.ndarray) -> bool:
        """Whether a graph takes this verifying batch: a bucket for its size, no
        entry of more rows than the graph's, and every padded context within the
        bound the tables were sized for."""
        return (self.bucket(len(q_lens)) is not None and int(q_lens.max()) <= self.query_len
                and int(num_computed.max()) + self.query_len <= self.max_model_len)

    def run_verify(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   q_lens: np.ndarray, num_computed: np.ndarray) -> GraphOutput:
        """Hidden states of a verifying batch (every entry's 1 + d rows, d <= k),
        in its own row order. q_lens, num_computed: each entry's rows and tokens
        computed before this step (the plan's). Check fits_verify first."""
        n, q = len(q_lens), self.query_len
        b = self.bucket(n)
        rows = int(q_lens.sum())
        width = meta.block_tables.shape[1]
        device = self.input_ids.device
        if rows == n * q:  # every entry with k drafts: the graph's layout already
            dest = None
            self.input_ids[:rows].copy_(input_ids, non_blocking=True)
            self.positions[:rows].copy_(positions, non_blocking=True)
            self.slot_mapping[:rows].copy_(meta.slot_mapping, non_blocking=True)
        else:
            dest = torch.from_numpy(padded_rows(q_lens, q)).to(device, non_blocking=True)
            self.padded_replays += 1
            self.slot_mapping[: n * q].fill_(-1)  # padding rows write no KV
            self.input_ids.index_copy_(0, dest, input_ids)
            self.positions.index_copy_(0, dest, positions)
            self.slot_mapping.index_copy_(0, dest, meta.slot_mapping)
        # Each entry's context with its padding rows: they come after its real ones.
        padded = torch.from_numpy((num_computed + q).astype(np.int32))
        self.seq_lens[:n].copy_(padded.to(device, non_blocking=True), non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if b > n:  # padding sequences: no write, q tokens of context
            self.slot_mapping[n * q: b * q].fill_(-1)
            self.seq_lens[n:b].fill_(q)
        self.graphs[b].replay()
        self.replays += 1
        return GraphOutput(self.outputs[b], rows, dest)
