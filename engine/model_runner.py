"""Turns a scheduler plan into tensors, runs the model, samples.

The batch is flattened into one sequence of tokens with no padding; each
request contributes the tokens [start, start + num_new_tokens) of its plan.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from tandem.engine.block_table import BlockTables
from tandem.engine.config import EngineConfig
from tandem.engine.loader import ModelInfo, load_weights
from tandem.engine.models import LlamaFamilyForCausalLM
from tandem.engine.models.llama import head_dim_of
from tandem.engine.request import Request
from tandem.engine.sampler import SampleResult, Sampler
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.kernels import AttentionMetadata
from tandem.kernels.ops import set_attention_backend, triton_backend_selected

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
    # rows of the flattened batch whose logits are sampled; None: every row, in order
    logits_indices: Optional[torch.Tensor]
    sampling: list[ScheduledRequest]


class ModelRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.device = torch.device(config.resolved_device())
        # Before anything asks which kernels run (one setting per process: kernels/ops.py).
        set_attention_backend(config.attention_backend, self.device.type)
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
        # One allocation for every layer: it can be exported whole to another
        # process (the direct KV transfer) and each layer's cache is a view of it.
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.shared_kv = None
        if config.kv_transfer == "direct" and config.kv_role in ("producer", "both"):
            from tandem.engine.connector.shared_cache import ExportedKVCache

            self.shared_kv = ExportedKVCache(shape, self.dtype, self.device)
            self.kv_cache = self.shared_kv.tensor
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        log.info("model on %s (%s), %d KV blocks of %d tokens", self.device, self.dtype,
                 self.num_blocks, self.block_size)
        self.graphs = None  # set by enable_cuda_graphs once the engine knows max_model_len
        self.block_tables = BlockTables(config.scheduler.max_num_seqs)
        self._arange = np.arange(config.scheduler.max_num_seqs + 1, dtype=np.int64)
        # A decode-only batch's query starts are 0..n: views of one device
        # arange, kept per batch size (a slice costs as much as a small copy).
        self._dev_arange32 = torch.arange(config.scheduler.max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self._decode_query_starts: dict[int, torch.Tensor] = {}
        # Only the torch twins read the host copies of query starts and lengths;
        # the Triton kernels take the device tensors.
        self._host_lists = not (self.device.type == "cuda" and triton_backend_selected())

    def enable_cuda_graphs(self, max_model_len: int) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        if not triton_backend_selected():
            # The torch twins read lengths on the host, which a graph cannot capture.
            log.warning("--attention-backend torch: decode runs eagerly, without CUDA graphs")
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
        """The step's tensors. A few passes over the plan collect per-request
        numbers; everything per token is whole-array numpy, and the block tables
        are updated in place (BlockTables), so a decode step costs little per request.
        The result is valid until the next prepare()."""
        scheduled = plan.scheduled
        n = len(scheduled)
        if n >= len(self._arange):
            self._arange = np.arange(2 * n + 1, dtype=np.int64)
        if n and plan.num_plain_decodes == n and n < len(self._dev_arange32):
            return self._prepare_decodes(scheduled)
        bs = self.block_size
        tables = self.block_tables.update([s.block_ids for s in scheduled])
        starts = np.array([s.start for s in scheduled], dtype=np.int64)
        q_lens = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
        num_tokens = np.array([len(s.request.all_token_ids) for s in scheduled], dtype=np.int64)
        seq_lens = starts + q_lens
        max_query_len = int(q_lens.max())
        if max_query_len == 1:  # decode-only: one row per request
            ids = [s.request.all_token_ids[s.start] for s in scheduled]
            query_start_loc = self._arange[: n + 1]
            positions, seq_of_token = starts, self._arange[:n]
        else:
            ids = []
            for s in scheduled:
                ids.extend(s.request.all_token_ids[s.start:s.start + s.num_new_tokens])
            query_start_loc = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(q_lens, out=query_start_loc[1:])
            seq_of_token = np.repeat(self._arange[:n], q_lens)
            positions = np.arange(len(ids), dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], q_lens)
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        # A request samples when this step reaches its last known token.
        sample_rows = np.flatnonzero(seq_lens == num_tokens)
        logits_indices = query_start_loc[sample_rows + 1] - 1
        sampling = list(scheduled) if len(sample_rows) == n else [scheduled[i] for i in sample_rows.tolist()]
        seq_lens_cpu = seq_lens.tolist()
        dev = self.device

        def to_dev(a: np.ndarray, dtype=None) -> torch.Tensor:
            t = torch.from_numpy(a if dtype is None else a.astype(dtype))
            return t.to(dev, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=to_dev(slots),
            query_start_loc=to_dev(query_start_loc, np.int32),
            seq_lens=to_dev(seq_lens, np.int32),
            block_tables=to_dev(tables),
            max_query_len=max_query_len, max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_loc.tolist(), seq_lens_cpu=seq_lens_cpu)
        return BatchInputs(
            input_ids=to_dev(np.array(ids, dtype=np.int64)),
            positions=to_dev(positions),
            meta=meta, logits_indices=to_dev(logits_indices), sampling=sampling)

    def _prepare_decodes(self, scheduled: list[ScheduledRequest]) -> BatchInputs:
        """prepare() for a batch of plain decodes (SchedulerOutput.num_plain_decodes):
        one row per request, each at its last known token, all sampled; what
        prepare() would build, from two passes over the plan."""
        n = len(scheduled)
        bs = self.block_size
        tables = self.block_tables.update([s.block_ids for s in scheduled])
        positions = np.array([s.start for s in scheduled], dtype=np.int64)
        ids = np.array([s.request.all_token_ids[-1] for s in scheduled], dtype=np.int64)
        slots = tables[self._arange[:n], positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (positions + 1).astype(np.int32)
        dev = self.device
        query_starts = self._decode_query_starts.get(n)
        if query_starts is None:
            query_starts = self._decode_query_starts[n] = self._dev_arange32[: n + 1]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            query_start_loc=query_starts,
            seq_lens=torch.from_numpy(seq_lens).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            max_query_len=1, max_seq_len=int(seq_lens.max()))
        if self._host_lists:
            meta.query_start_loc_cpu = self._arange[: n + 1].tolist()
            meta.seq_lens_cpu = seq_lens.tolist()
        return BatchInputs(
            input_ids=torch.from_numpy(ids).to(dev, non_blocking=True),
            positions=torch.from_numpy(positions).to(dev, non_blocking=True),
            meta=meta, logits_indices=None, sampling=list(scheduled))

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
        rows = hidden if batch.logits_indices is None else hidden[batch.logits_indices]
        logits = self.model.compute_logits(rows)
        requests: list[Request] = [s.request for s in batch.sampling]
        return batch.sampling, self.sampler(logits, requests)
