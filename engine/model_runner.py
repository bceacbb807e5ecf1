"""Turns a scheduler plan into tensors, runs the model, samples.

The batch is flattened into one sequence of tokens with no padding; each
request contributes the tokens [start, start + num_new_tokens) of its plan.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.loader import ModelInfo, load_weights
from tandem.engine.models import LlamaFamilyForCausalLM
from tandem.engine.models.llama import head_dim_of
from tandem.engine.request import Request
from tandem.engine.sampler import SampleResult, Sampler
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.kernels import AttentionMetadata

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flattened batch whose logits are sampled
    sampling: list[ScheduledRequest]


class ModelRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = resolve_dtype(config.model.dtype, self.device.type)
        hf = info.hf_config
        self.block_size = config.cache.block_size
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = head_dim_of(hf)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = LlamaFamilyForCausalLM(hf)
        finally:
            torch.set_default_dtype(previous)
        load_weights(self.model, info.source, hf, seed=config.model.seed)
        if self.device.type == "cuda":
            # On the CPU the separate products keep the arithmetic identical to HF's
            # (the token-exact tests); on a GPU fewer, larger GEMVs win.
            self.model.fuse_projections()
        self.model.eval()
        self.sampler = Sampler(hf.vocab_size)
        self.num_blocks = self._decide_num_blocks()
        shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.num_layers)]
        log.info("model on %s (%s), %d KV blocks of %d tokens", self.device, self.dtype,
                 self.num_blocks, self.block_size)
        self.graphs = None  # set by enable_cuda_graphs once the engine knows max_model_len

    def enable_cuda_graphs(self, max_model_len: int) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        from tandem.engine.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.config.scheduler.max_num_seqs,
                                   max_model_len, self.block_size, self.device)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers (K and V)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _decide_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type == "cuda":
            # Memory cached by earlier engines in this process counts as used otherwise.
            import gc

            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # gpu_memory_utilization is this process's share of the device (as in
            # vLLM), weights included, so engines can split one GPU between them.
            budget = min(free, cache.gpu_memory_utilization * total - torch.cuda.memory_reserved(self.device))
            # leave room for activations of one full step
            budget -= 2 * self.config.scheduler.max_num_batched_tokens * self.model.config.hidden_size * 64
        else:
            budget = cache.cpu_kv_cache_gib * 2**30
        num = int(budget // self.block_bytes)
        if num < 2:
            raise ValueError("not enough memory for the KV cache; lower the model size or raise "
                             "gpu_memory_utilization / cpu_kv_cache_gib")
        return num

    # ---- inputs --------------------------------------------------------
    def prepare(self, plan: SchedulerOutput) -> BatchInputs:
        if all(s.num_new_tokens == 1 for s in plan.scheduled):
            return self._prepare_decode(plan)
        bs = self.block_size
        ids: list[int] = []
        positions, slots = [], []
        starts = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        max_blocks = max(len(s.block_ids) for s in plan.scheduled)
        tables = np.zeros((len(plan.scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(plan.scheduled):
            end = s.start + s.num_new_tokens
            ids.extend(s.request.all_token_ids[s.start:end])
            pos = np.arange(s.start, end, dtype=np.int64)
            table = np.asarray(s.block_ids, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            tables[i, : len(s.block_ids)] = table
            starts.append(starts[-1] + s.num_new_tokens)
            seq_lens.append(end)
            if s.samples:
                logits_rows.append(starts[-1] - 1)
                sampling.append(s)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max(s.num_new_tokens for s in plan.scheduled),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            sampling=sampling,
        )

    def _prepare_decode(self, plan: SchedulerOutput) -> BatchInputs:
        """One token per request: plain integer arithmetic, no per-request numpy calls."""
        bs = self.block_size
        n = len(plan.scheduled)
        ids, positions, slots, seq_lens = [0] * n, [0] * n, [0] * n, [0] * n
        max_blocks = max(len(s.block_ids) for s in plan.scheduled)
        tables = np.zeros((n, max_blocks), dtype=np.int32)
        sampling = []
        for i, s in enumerate(plan.scheduled):
            pos = s.start
            ids[i] = s.request.all_token_ids[pos]
            positions[i] = pos
            slots[i] = s.block_ids[pos // bs] * bs + pos % bs
            seq_lens[i] = pos + 1
            tables[i, : len(s.block_ids)] = s.block_ids
            if s.samples:
                sampling.append(s)
        dev = self.device
        starts = list(range(n + 1))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            max_query_len=1, max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
        rows = [i for i, s in enumerate(plan.scheduled) if s.samples]
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
            meta=meta, logits_indices=torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True),
            sampling=sampling)

    # ---- execution -----------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, after_layer: Optional[Callable[[int], None]] = None
                ) -> tuple[list[ScheduledRequest], SampleResult]:
        batch = self.prepare(plan)
        if (self.graphs is not None and after_layer is None and batch.meta.is_decode_only
                and self.graphs.bucket(len(plan.scheduled)) is not None):
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, after_layer)
        if not batch.sampling:
            return [], SampleResult([], [])
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        requests: list[Request] = [s.request for s in batch.sampling]
        return batch.sampling, self.sampler(logits, requests)
