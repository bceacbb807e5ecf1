"""Turns a scheduler plan into tensors and runs the model; returns the
logits of the plan's sampled entries (sampling is the engine's).

The batch is flattened into one sequence of tokens with no padding; entry i
contributes its tokens [num_computed_tokens[i], + num_new_tokens[i]). The
runner reads only the plan (plain data) and its own state: the block-table
rows it keeps per request (block_table.py) and the KV cache.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import mmap
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tandem.engine import fp8
from tandem.engine.block_table import BlockTable
from tandem.engine.config import EngineConfig
from tandem.engine.connector.base import KVCacheLayout
from tandem.engine.host_kv_tier import HostKVBuffer
from tandem.engine.loader import ModelInfo, load_weights
from tandem.engine.models import build_model
from tandem.engine.models.llama import LayerHook, has_kv_scales, head_dim_of
from tandem.engine.plan import SchedulerOutput
from tandem.engine.tensor_parallel import rank_device, shard_size, tp_group
from tandem.kernels import AttentionMetadata, compile_log
from tandem.kernels.kv_cache_dtype import FP8_KV_DTYPE
from tandem.kernels.ops import set_attention_backend, triton_backend_selected

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# The ways ModelRunner.forward runs a step (ModelRunner.last_path).
FORWARD_PATHS = ("decode graphs", "verifying graphs", "piecewise graphs", "eager")


def verify_shape(plan: SchedulerOutput) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(rows, tokens computed before) of each entry, where the step is a
    verifying one a graph can take: every entry samples, each a decode with
    its draft tokens (1 + d rows, d > 0 for one at least); else None."""
    drafts = plan.num_draft_tokens
    if not drafts or len(plan.sampled) != plan.num_entries or not any(drafts):
        return None
    q_lens = np.array(plan.num_new_tokens, dtype=np.int64)
    if not np.array_equal(q_lens, np.array(drafts, dtype=np.int64) + 1):
        return None
    return q_lens, np.array(plan.num_computed_tokens, dtype=np.int64)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for --kv-cache-dtype `name` (config.KVCacheDtype)."""
    if name == "auto":
        return model_dtype
    if name not in ("fp8", "fp8_e4m3"):
        raise ValueError(f"--kv-cache-dtype must be one of auto, fp8, fp8_e4m3; got {name!r}")
    too_old = fp8.gpu_without_fp8(device)
    if too_old:
        raise ValueError(f"--kv-cache-dtype {name}: the kernels' e4m3 conversions need a GPU of compute "
                         f"capability 8.9 or newer (Ada, Hopper); this one is {too_old}: use "
                         "--kv-cache-dtype auto")
    return FP8_KV_DTYPE


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # rows of the flattened batch whose logits are sampled; None: every row, in order
    logits_indices: Optional[torch.Tensor]


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                    block_layout: str = "NHD") -> torch.Tensor:
    """A zeroed KV cache of `shape` ([..., block_size, kv_heads, head_dim]).
    block_layout HND stores each block heads-outer ([..., kv_heads, block_size,
    head_dim] in memory) and returns the transposed view, so everything that
    indexes the cache sees the same shape either way.

    On the CPU its memory is an anonymous mapping, whose
    pages the kernel hands out zeroed when first written: the process takes
    memory for the blocks it has used, not for all of them at start (torch.zeros
    writes every page, 1 GiB for the default --cpu-kv-cache-gib): the two
    engines of a test stack held 3.7 GB for a few short prompts."""
    if block_layout not in ("NHD", "HND"):
        raise ValueError(f"block_layout must be NHD or HND, got {block_layout!r}")
    stored = shape if block_layout == "NHD" else (*shape[:-3], shape[-2], shape[-3], shape[-1])
    if torch.device(device).type != "cpu":
        cache = torch.zeros(stored, dtype=dtype, device=device)
    else:
        nbytes = math.prod(stored) * dtype.itemsize
        cache = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(stored)
    return cache if block_layout == "NHD" else cache.transpose(-3, -2)


class ModelRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo, extra_block_bytes: int = 0) -> None:
        """extra_block_bytes: what each KV block costs besides its own bytes
        when the cache is sized from memory (a draft model's block for every
        block of the target's: speculative decoding)."""
        self.config = config
        # Each tensor-parallel rank on its own GPU (tensor_parallel.py).
        group = tp_group()
        self.device = (rank_device(config.resolved_device(), group.rank) if group.world_size > 1
                       else torch.device(config.resolved_device()))
        # Before anything asks which kernels run (one setting per process: kernels/ops.py).
        set_attention_backend(config.attention_backend, self.device.type)
        if self.device.type == "cuda":
            compile_log.install()  # a step that waits for a compile says so (the slow-step log)
        self.dtype = resolve_dtype(config.model.dtype, self.device.type)
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.cache_dtype, self.dtype, self.device)
        hf = info.hf_config
        self.block_size = config.cache.block_size
        # Checked before any weight is read: an FP8 the model or GPU cannot run fails fast.
        self.quantization = fp8.effective_quantization(hf, config.model.quantization, self.device)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(hf)
        finally:
            torch.set_default_dtype(previous)
        load_weights(self.model, info.source, hf, seed=config.model.seed)
        if self.device.type == "cuda":
            # On the CPU the separate products keep the arithmetic identical to HF's
            # (the token-exact tests); on a GPU fewer, larger GEMVs win.
            self.model.fuse_projections()
        if self.quantization == "fp8" and not fp8.is_quantized(self.model):
            fp8.quantize_model(self.model)  # --quantization fp8 on a bf16 checkpoint
        self.model.eval()
        # This rank's KV heads: each tensor-parallel rank caches its own
        num_kv_heads = shard_size(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads, "KV heads")
        self.num_heads = shard_size(hf.num_attention_heads, "attention heads")  # this rank's
        # The model id and dtypes name the blocks: KV of another model or
        # precision never matches, in this process or in a shared store.
        layout = KVCacheLayout(hf.num_hidden_layers, 0, self.block_size, num_kv_heads, head_dim_of(hf),
                               self.kv_dtype, self.device, model_key=self._model_key(info.model_id))
        self.layout = dataclasses.replace(
            layout, num_blocks=self._decide_num_blocks(layout.block_bytes + extra_block_bytes))
        self.kv_cache: Optional[torch.Tensor] = None  # bind_kv_cache
        # The host KV tier's memory (swap_space_gib; 0: none): whole blocks of every layer.
        self.num_host_slots = int(config.cache.swap_space_gib * 2**30 // self.layout.block_bytes)
        if config.cache.swap_space_gib > 0 and self.num_host_slots < 1:
            raise ValueError(f"swap_space {config.cache.swap_space_gib} GiB holds no KV block of "
                             f"{self.layout.block_bytes} bytes: give at least that, or 0 to turn swapping off")
        self.host_kv: Optional[HostKVBuffer] = None
        if self.num_host_slots:
            self.host_kv = HostKVBuffer(self.num_host_slots, self.layout.shape, self.kv_dtype,
                                        pin=self.device.type == "cuda")
        self.kv_caches: list[torch.Tensor] = []
        self.graphs = None  # set by enable_cuda_graphs once the engine knows max_model_len
        self.verify_graphs = None  # the same, for speculative decoding's verifying steps
        self.piecewise = None  # the same, for the other steps of up to piecewise_graphs.MAX_TOKENS tokens
        # Which of forward's paths the last step took (FORWARD_PATHS): for `bench throughput
        # --step-breakdown`, which sums the run's time by path.
        self.last_path = ""
        self.warmup_report = None  # set by warm_up_kernels, where it runs
        self.block_table = BlockTable(config.scheduler.max_num_seqs)
        self._arange = np.arange(config.scheduler.max_num_seqs + 1, dtype=np.int64)
        # A decode-only batch's query starts are 0..n: views of one device
        # arange, kept per batch size (a slice costs as much as a small copy).
        self._dev_arange32 = torch.arange(config.scheduler.max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self._decode_query_starts: dict[int, torch.Tensor] = {}
        # Only the torch twins read the host copies of query starts and lengths;
        # the Triton kernels take the device tensors.
        self._host_lists = not (self.device.type == "cuda" and triton_backend_selected())

    def _model_key(self, model_id: str) -> str:
        # FP8 weights compute other K/V than the bf16 ones, and an FP8 cache stores
        # them rounded: their blocks get other names.
        suffix = f"|{self.quantization}" if self.quantization else ""
        if self.kv_dtype != self.dtype:
            suffix += f"|kv={self.kv_dtype}"
            if has_kv_scales(self.model):  # the checkpoint's scales divide what it stores
                suffix += "|kv-scales"
        return f"{model_id}|{self.dtype}{suffix}"

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def set_num_blocks(self, num_blocks: int) -> None:
        """Size the KV cache before it is bound (a draft model's cache takes the
        target's number of blocks, known only once the target's runner exists)."""
        if self.kv_cache is not None:
            raise RuntimeError("the KV cache is bound already")
        self.layout = dataclasses.replace(self.layout, num_blocks=num_blocks)

    def bind_kv_cache(self, kv_cache: Optional[torch.Tensor] = None) -> None:
        """Use `kv_cache` (a KV connector's, e.g. shared memory) or a fresh zeroed
        one. One allocation for every layer; each layer's cache is a view of it."""
        if kv_cache is None:
            kv_cache = zeroed_kv_cache(self.layout.shape, self.kv_dtype, self.device,
                                       self.config.cache.block_layout)
        elif tuple(kv_cache.shape) != self.layout.shape or kv_cache.dtype != self.kv_dtype:
            raise ValueError(f"KV cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match the "
                             f"layout {self.layout.shape} {self.kv_dtype}")
        self.kv_cache = kv_cache
        self.kv_caches = list(kv_cache.unbind(0))
        log.info("model on %s (%s), %d KV blocks of %d tokens (%s), %s layout", self.device, self.dtype,
                 self.num_blocks, self.block_size, self.kv_dtype, self.config.cache.block_layout)

    def warm_up_kernels(self, max_model_len: int) -> None:
        """Compile the Triton kernel variants any step can need, now rather than
        mid-serving (kernel_warmup.py). On every tensor-parallel rank, in the
        same order, before enable_cuda_graphs."""
        if (self.device.type != "cuda" or not triton_backend_selected()
                or not self.config.kernel_warmup):
            return
        from tandem.engine import kernel_warmup

        sched = self.config.scheduler
        batches = kernel_warmup.warmup_batches(
            num_heads=self.num_heads,
            num_kv_heads=self.layout.num_kv_heads, head_dim=self.layout.head_dim,
            max_model_len=max_model_len, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens, device=self.device,
            cache_dtype=self.kv_dtype)
        self.warmup_report = report = kernel_warmup.warm_up(self.model, self.kv_caches, batches,
                                                            self.block_size, self.device)
        log.info("kernel warm-up: %d batches in %.1f s, %s Triton kernels compiled", report.batches,
                 report.seconds, report.compiled if report.compiled >= 0 else "(uncounted)")

    def enable_cuda_graphs(self, max_model_len: int) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        if not triton_backend_selected():
            # The torch twins read lengths on the host, which a graph cannot capture.
            log.warning("--attention-backend torch: decode runs eagerly, without CUDA graphs")
            return
        from tandem.engine.cuda_graphs import DecodeGraphs, verify_buckets
        from tandem.engine.piecewise_graphs import PiecewiseGraphs

        sched = self.config.scheduler
        self.graphs = DecodeGraphs(self.model, self.kv_caches, sched.max_num_seqs,
                                   max_model_len, self.block_size, self.device)
        if self.config.piecewise_cuda_graphs:
            # Prompt chunks, alone or beside decodes: the layers between the attentions.
            self.piecewise = PiecewiseGraphs(self.model, self.kv_caches, sched.max_num_batched_tokens,
                                             self.device)
        spec = self.config.speculative
        if spec is not None:
            # Verifying steps (1 + k rows a request) replay graphs of their own; eagerly
            # each cost a dozen decode steps (docs/benchmarks.md, speculative decoding).
            q = 1 + spec.num_speculative_tokens
            self.verify_graphs = DecodeGraphs(
                self.model, self.kv_caches, sched.max_num_seqs, max_model_len, self.block_size,
                self.device, query_len=q,
                sizes=verify_buckets(sched.max_num_seqs, q, sched.max_num_batched_tokens))

    def release_cuda_graphs(self) -> None:
        """Drop the CUDA graphs (before the TP group goes: see DecodeGraphs.release)."""
        for graphs in (self.graphs, self.verify_graphs, self.piecewise):
            if graphs is not None:
                graphs.release()
        self.graphs = self.verify_graphs = self.piecewise = None

    def _decide_num_blocks(self, block_bytes: int) -> int:
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
        num = int(budget // block_bytes)
        if num < 2:
            raise ValueError("not enough memory for the KV cache; lower the model size or raise "
                             "gpu_memory_utilization / cpu_kv_cache_gib")
        return num

    # ---- inputs --------------------------------------------------------
    def prepare(self, plan: SchedulerOutput, pending_tokens: Optional[torch.Tensor] = None) -> BatchInputs:
        """The step's tensors. One pass over the plan brings the block tables up
        to date; everything else is whole-array numpy, so a decode step costs
        little per request. pending_tokens: the tokens the step in flight
        samples, on the device, where the plan's pending entries read their
        last input (asynchronous scheduling). The result is valid until the
        next prepare()."""
        n = plan.num_entries
        if n >= len(self._arange):
            self._arange = np.arange(2 * n + 1, dtype=np.int64)
        bs = self.block_size
        tables = self.block_table.update(plan)
        starts = np.array(plan.num_computed_tokens, dtype=np.int64)
        dev = self.device
        decode_only = plan.is_decode_only
        if decode_only:  # one row per entry
            positions, seq_of_token = starts, self._arange[:n]
            seq_lens = starts + 1
            query_start_loc = self._arange[: n + 1]
            max_query_len = 1
        else:
            q_lens = np.array(plan.num_new_tokens, dtype=np.int64)
            seq_lens = starts + q_lens
            query_start_loc = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(q_lens, out=query_start_loc[1:])
            seq_of_token = np.repeat(self._arange[:n], q_lens)
            positions = np.arange(len(plan.token_ids), dtype=np.int64) + np.repeat(starts - query_start_loc[:-1],
                                                                                  q_lens)
            max_query_len = int(q_lens.max())
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens32 = seq_lens.astype(np.int32)
        if decode_only and n < len(self._dev_arange32):
            query_starts = self._decode_query_starts.get(n)
            if query_starts is None:
                query_starts = self._decode_query_starts[n] = self._dev_arange32[: n + 1]
        else:
            query_starts = torch.from_numpy(query_start_loc.astype(np.int32)).to(dev, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            query_start_loc=query_starts,
            seq_lens=torch.from_numpy(seq_lens32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            max_query_len=max_query_len, max_seq_len=int(seq_lens.max()))
        if self._host_lists:
            meta.query_start_loc_cpu = query_start_loc.tolist()
            meta.seq_lens_cpu = seq_lens.tolist()
        # A request samples when this step reaches its last known token.
        logits_indices = None
        if plan.num_draft_tokens:
            # Speculative decoding: every row of an entry's draft tokens, and the
            # row before them (its last known token), is verified.
            counts = np.array(plan.num_draft_tokens, dtype=np.int64) + 1
            ends = query_start_loc[np.array(plan.sampled, dtype=np.int64) + 1]
            firsts = np.cumsum(counts) - counts
            rows_sampled = np.repeat(ends - counts - firsts, counts) + np.arange(int(counts.sum()))
            if len(rows_sampled) < len(plan.token_ids):  # else every row, in order: no gather
                logits_indices = torch.from_numpy(rows_sampled).to(dev, non_blocking=True)
        elif len(plan.sampled) != len(plan.token_ids):
            rows_sampled = query_start_loc[np.array(plan.sampled, dtype=np.int64) + 1] - 1
            logits_indices = torch.from_numpy(rows_sampled).to(dev, non_blocking=True)
        input_ids = torch.from_numpy(np.array(plan.token_ids, dtype=np.int64)).to(dev, non_blocking=True)
        if plan.pending_entries:
            # Each such entry's last input row; the token comes from the device,
            # queued behind the step that samples it.
            rows = query_start_loc[np.array(plan.pending_entries, dtype=np.int64) + 1] - 1
            sources = torch.from_numpy(np.array(plan.pending_rows, dtype=np.int64)).to(dev, non_blocking=True)
            input_ids[torch.from_numpy(rows).to(dev, non_blocking=True)] = pending_tokens[sources]
        return BatchInputs(input_ids=input_ids, positions=torch.from_numpy(positions).to(dev, non_blocking=True),
                           meta=meta, logits_indices=logits_indices)

    # ---- execution -----------------------------------------------------
    def swap(self, plan: SchedulerOutput) -> None:
        """The plan's host-tier copies: before anything of the step writes the cache."""
        if plan.swap_out or plan.swap_in:
            self.host_kv.copy(self.kv_cache, plan.swap_out, plan.swap_in)

    def execute(self, plan: SchedulerOutput, before_layer: Optional[LayerHook] = None,
                after_layer: Optional[LayerHook] = None) -> Optional[torch.Tensor]:
        """prepare() then forward(): the logits of the plan's sampled entries."""
        return self.forward(self.prepare(plan), plan, before_layer, after_layer)

    @torch.inference_mode()
    def forward(self, batch: BatchInputs, plan: SchedulerOutput, before_layer: Optional[LayerHook] = None,
                after_layer: Optional[LayerHook] = None) -> Optional[torch.Tensor]:
        """Run the model over a prepared batch; the logits of the plan's sampled
        entries, in order (None when none samples); an entry with draft tokens
        has 1 + num_draft_tokens rows, in position order. The hooks run around each
        layer (the KV connector's layer-wise loads and saves). On GPUs,
        decode steps and verifying steps without hooks replay whole CUDA
        graphs; other steps of up to piecewise_graphs.MAX_TOKENS tokens, hooked
        ones too, the piecewise graphs, whose seams the hooks run at."""
        hooked = before_layer is not None or after_layer is not None
        verify = None if hooked or self.verify_graphs is None else verify_shape(plan)
        replayed = None
        if (self.graphs is not None and not hooked and batch.meta.is_decode_only
                and self.graphs.bucket(plan.num_entries) is not None):
            self.last_path = "decode graphs"
            replayed = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        elif verify is not None and self.verify_graphs.fits_verify(*verify):
            self.last_path = "verifying graphs"
            replayed = self.verify_graphs.run_verify(batch.input_ids, batch.positions, batch.meta, *verify)
        elif self.piecewise is not None and self.piecewise.bucket(batch.input_ids.shape[0]) is not None:
            self.last_path = "piecewise graphs"
            hidden = self.piecewise.run(batch.input_ids, batch.positions, batch.meta, before_layer, after_layer)
        else:
            self.last_path = "eager"
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                                before_layer, after_layer)
        if not plan.sampled:
            return None
        if replayed is not None:
            # The LM head over the bucket's rows, then the batch's taken: a
            # row count new to cuBLAS costs it a new plan (0.15 ms at 60 rows
            # on the H100; the head took 0.18 ms of host a decode step at
            # batch 64 and 0.71 ms a verifying one), and the batch's count
            # changes every few steps where its bucket's does not.
            logits = replayed.select(self.model.compute_logits(replayed.padded))
            return logits if batch.logits_indices is None else logits[batch.logits_indices]
        rows = hidden if batch.logits_indices is None else hidden[batch.logits_indices]
        return self.model.compute_logits(rows)
