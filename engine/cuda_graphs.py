"""CUDA graphs for decode steps (thesis 4.6): one graph per batch size bucket.

A decode-only step's launches are captured once per bucket and replayed with
the step's inputs copied into persistent buffers. Padding rows carry slot -1
(no K/V write) and context length 0 (the attention kernels return zeros for
them), so one graph serves every batch up to its bucket. The attention grid
is sized for the longest context the engine allows, a bound fixed at capture.
"""
from __future__ import annotations

import bisect
import gc
import logging
from typing import Optional

import torch

from tandem.kernels import AttentionMetadata
from tandem.engine.tensor_parallel import tp_group

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_batch: int,
                 max_model_len: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = [b for b in BUCKETS if b <= max_batch] or [1]
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], max_query_len=1,
            max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # A garbage collection inside a capture can destroy another, unreachable
        # CUDA graph (an earlier engine's in the same process), and destroying
        # a graph is not allowed while a stream captures: the capture fails.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_each()
        finally:
            if was_enabled:
                gc.enable()

    def _capture_each(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Under tensor parallelism NCCL's watchdog thread polls the events of
        # earlier collectives while this thread captures: "global" would
        # count those calls against the capture.
        mode = "thread_local" if tp_group().world_size > 1 else "global"
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            args = (self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b))
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                    self.model(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                self.outputs[b] = self.model(*args)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

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

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
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
        return self.outputs[b][:n]
