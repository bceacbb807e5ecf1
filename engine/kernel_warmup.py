"""Compile every Triton kernel variant a step can need, before the engine serves.

Triton compiles a kernel once for each set of compile-time choices it is
launched with, on the launching thread. Several choices follow the step:
the decode attention's split count follows the batch's longest context and
size (one kernel variant for one split, one for each fused combine width, a
second kernel per padded split count), the MoE and FP8 kernels' tiles follow
the token count, and integer arguments are specialized on being 1, a
multiple of 16 or neither. A step that meets a new set stops every request
in it for the compile: 0.6-0.9 s in the forward pass on the H200
(docs/benchmarks.md, issue 17's runs). CUDA graphs compile their decode
kernels at capture, but only for the longest context, and any step with
prefill tokens or KV-connector hooks runs eagerly.

So the engine runs its model once, eagerly, over synthetic batches chosen
to make every such choice once:
- token counts 1, 2, 3 and each power of two up to the step's token budget
  with the count one above it (tiles chosen by powers of two; integers that
  are 1, multiples of 16, or neither), as prompts;
- for each distinct set of decode-attention choices
  (kernels.attention_triton.decode_variants), a decode batch that makes it.
The batches write no KV (slot -1) and read the reserved block 0 only; their
outputs are dropped. Every tensor-parallel rank runs the same batches in the
same order (each forward pass holds collectives), before decode CUDA graphs
are captured.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from tandem.kernels import AttentionMetadata, compile_log
from tandem.kernels.attention_triton import decode_variants
from tandem.kernels.ops import FEW_ROWS_MAX

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupBatch:
    """One synthetic step: each sequence's new tokens and its context length
    (new tokens included), all of them prompt rows or all decodes."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


@dataclass
class WarmupReport:
    batches: int
    compiled: int  # kernels Triton compiled meanwhile (-1: this Triton cannot tell)
    seconds: float


def prompt_token_counts(budget: int) -> list[int]:
    """1, 2, 3, then each power of two up to budget with the count above it, and budget."""
    counts = {1, 2, 3, budget}
    p = 4
    while p <= budget:
        counts.update((p, min(p + 1, budget)))
        p *= 2
    return sorted(c for c in counts if 1 <= c <= budget)


def prompt_batch(num_tokens: int, max_model_len: int) -> WarmupBatch:
    """num_tokens prompt rows, in as few sequences as max_model_len allows."""
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    return WarmupBatch(tuple(lens), tuple(lens))


def warmup_batches(*, num_heads: int, num_kv_heads: int, head_dim: int, max_model_len: int,
                   max_num_seqs: int, max_num_batched_tokens: int,
                   device: torch.device, cache_dtype: Optional[torch.dtype] = None) -> list[WarmupBatch]:
    """The batches that make every compile-time choice a step of this engine can
    make (over a KV cache of cache_dtype: an FP8 cache's decode tiles differ)."""
    batches = [prompt_batch(n, max_model_len) for n in prompt_token_counts(max_num_batched_tokens)]
    variants = decode_variants(num_heads, num_kv_heads, head_dim, max_model_len,
                               min(max_num_seqs, max_num_batched_tokens), device, cache_dtype=cache_dtype)
    for num_seqs, longest in sorted(set(variants.values())):
        # One sequence at the longest context; the others at 1 token.
        batches.append(WarmupBatch((1,) * num_seqs, (longest,) + (1,) * (num_seqs - 1)))
    return batches


def batch_inputs(batch: WarmupBatch, block_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input ids (token 0), positions and metadata of a batch that writes no KV
    and reads block 0 for its whole context."""
    q_lens = torch.tensor(batch.query_lens, dtype=torch.int64)
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=starts[1:])
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(batch.query_lens, batch.seq_lens)])
    width = -(-max(batch.seq_lens) // block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch.num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=starts.to(torch.int32).to(device),
        seq_lens=seq_lens.to(torch.int32).to(device),
        block_tables=torch.zeros(len(q_lens), width, dtype=torch.int32, device=device),
        max_query_len=max(batch.query_lens), max_seq_len=max(batch.seq_lens))
    # The torch twins read these on the host (tests run the warm-up on the CPU).
    meta.query_start_loc_cpu = starts.tolist()
    meta.seq_lens_cpu = seq_lens.tolist()
    input_ids = torch.zeros(batch.num_tokens, dtype=torch.int64, device=device)
    return input_ids, positions.to(device), meta


def run_batches(model: torch.nn.Module, kv_caches: list[torch.Tensor], batches: list[WarmupBatch],
                block_size: int, device: torch.device) -> Iterator[WarmupBatch]:
    """Each batch through the model, yielded once queued. No sampling, and
    logits only for batches of up to FEW_ROWS_MAX tokens: the LM heads that
    take a Triton kernel (the GEMVs of kernels.ops.linear)."""
    with torch.inference_mode():
        for batch in batches:
            input_ids, positions, meta = batch_inputs(batch, block_size, device)
            hidden = model(input_ids, positions, kv_caches, meta)
            if batch.num_tokens <= FEW_ROWS_MAX:
                model.compute_logits(hidden)
            yield batch


def warm_up(model: torch.nn.Module, kv_caches: list[torch.Tensor], batches: list[WarmupBatch],
            block_size: int, device: torch.device) -> WarmupReport:
    """Run the batches, logging progress every 10 s; what they took, and how
    many kernels Triton compiled meanwhile."""
    counting = compile_log.install()
    before = compile_log.compiles()
    start = time.monotonic()
    done = 0
    last_note = start
    for _ in run_batches(model, kv_caches, batches, block_size, device):
        done += 1
        if time.monotonic() - last_note > 10:  # a first start compiles for tens of seconds
            log.info("kernel warm-up: %d of %d batches", done, len(batches))
            last_note = time.monotonic()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    compiled = compile_log.compiles() - before if counting else -1
    return WarmupReport(len(batches), compiled, time.monotonic() - start)
