"""Split-KV ("flash-decoding") attention for batches of one query token per sequence.

Decode reads each sequence's whole KV context for one query token: the work
is memory bound and, at small batch, a grid of one program per (sequence, KV
head) leaves most of the GPU idle. So each sequence's context is cut into
as many partitions as the grid has splits (whole BLOCK_N tiles each, fewer
partitions when the context is shorter than that many tiles); program (seq,
kv_head, split) computes attention of
all query heads that share the KV head (GQA: the KV tile is read once for the
whole group) over its partition, and writes a partial result: the
partition's normalised output and its log-sum-exp (base 2). The partitions of
each (seq, head) are then combined by their log-sum-exps, in one of two ways:

- fused (the default): each (seq, kv_head) has a counter in global memory;
  a program that wrote its partial result adds one to it, and the program
  that arrives last combines the partitions and sets the counter back to
  zero. One launch instead of two: at small batch the second launch and its
  round trips to memory were a tenth or more of the call. A sequence whose
  context fits in one partition skips the partial results altogether.
- a second kernel (_decode_reduce_kernel) over (seq, head): faster where
  there are many splits, whose combine it spreads over group-times more
  programs (attention_triton.DecodeConfig.fused_max_splits chooses).

Invariants: a sequence's partition size is a multiple of BLOCK_N, and the
grid's splits times it cover the sequence. A partition that starts at or
beyond its sequence's length is empty: fused, it does nothing (the counter
waits only for the sequence's active partitions); with the reduce kernel it
writes log-sum-exp -inf (weight 0) and a zero output. So grids may be sized
for meta.max_seq_len or any bound above it (as a CUDA graph captured for the
longest context needs): the host's partition_size only sets the split count,
and sequences shorter than the grid's bound still use every split. A
sequence of length 0 (CUDA-graph padding) gets a zero output. Counters are
zero between calls; calls that share them must not overlap (one stream per
device, see split_counters). No host syncs: every grid size
is a host-side int.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.common_triton import dot_settings, fp16_products, mma, pdl_launch, pdl_prologue

LOG2E = 1.4426950408889634

# Per device: the int32 counters of the fused split reduce. A call leaves them
# zero; a CUDA graph keeps the address it captured, so a buffer outgrown by a
# larger batch is kept alive, never freed. Calls on one device must not
# overlap (the engine runs attention on one stream): they would share counters.
_split_counters: dict[torch.device, torch.Tensor] = {}
_outgrown_counters: list[torch.Tensor] = []


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed counters on `device`."""
    counters = _split_counters.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Memory allocated now would belong to the graph being captured.
            raise RuntimeError("decode attention needs more split counters during a CUDA "
                               "graph capture; run the captured batch size once before capturing")
        if counters is not None:
            _outgrown_counters.append(counters)
        # Room for 512 sequences of 8 KV heads before the first growth; a CUDA
        # graph's warm-up run (outside its capture) sizes it for that graph.
        counters = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _split_counters[device] = counters
    return counters


# Triton compiles a kernel once per pattern of its integer arguments (1, a
# multiple of 16, other): these change with the batch (the block table's width,
# the split count) and would multiply the variants a serving engine compiles,
# each in the middle of a step (engine/kernel_warmup.py). They index scalars
# or rows, never vectorized loads, so their divisibility buys nothing.
_VARYING_PARTITION_ARGS = ["stride_bt_seq", "stride_pl_seq", "stride_pl_head"]
_VARYING_REDUCE_ARGS = ["stride_pl_seq", "stride_pl_head", "num_splits"]


@triton.jit(do_not_specialize=_VARYING_PARTITION_ARGS)
def _decode_partition_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
    scale_log2,
    stride_q_tok, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    num_kv_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, FP16_PRODUCTS: tl.constexpr, PDL: tl.constexpr,
    QLEN: tl.constexpr = 1, HEADS_FIRST: tl.constexpr = False, VALUES_AFTER_SCORES: tl.constexpr = False,
):
    """QLEN > 1: each sequence's last QLEN tokens are its queries (rows
    seq * QLEN + t of q and out), each seeing the context up to itself; a
    program's rows are then its KV head's GROUP heads of every one of them
    (GROUP_PAD covers QLEN * GROUP), so the tile is read once for all.

    HEADS_FIRST: the grid is (KV heads, sequences, splits) instead of
    (sequences, KV heads, splits). Programs start in grid order, so the KV
    heads of one sequence then run side by side and read the same blocks
    together; with the sequences first, the programs running at once read
    one KV head's 128-byte (FP8) or 256-byte (16-bit) rows of many blocks.
    VALUES_AFTER_SCORES: a tile's values are loaded (and widened, over an
    FP8 cache) after its scores, so the widened keys and values are not in
    registers together. Both are DecodeConfig's, unmeasured as yet
    (docs/kernels.md, Not done / next)."""
    pdl_prologue(PDL)
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each sequence spreads its own context over the grid's splits, in whole
    # tiles: a grid sized for a longer context (a CUDA graph's) still puts
    # every split to work on a short one.
    partition_size = tl.maximum(tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N), 1) * BLOCK_N
    start = split * partition_size
    rows = tl.arange(0, GROUP_PAD)  # query heads of this KV head (of each query token), padded for tl.dot
    row_mask = rows < QLEN * GROUP
    heads = kv_head * GROUP + rows % GROUP
    toks_q = seq.to(tl.int64) * QLEN + rows // GROUP  # each row's query token
    dims = tl.arange(0, HEAD_DIM)
    o_rows = out_ptr + toks_q[:, None] * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
    # Issued before the length is known: the two loads travel together.
    q = tl.load(q_ptr + toks_q[:, None] * stride_q_tok + heads[:, None] * stride_q_head
                + dims[None, :], mask=row_mask[:, None], other=0.0)
    if FP16_PRODUCTS:  # an FP8 cache (common_triton.fp16_products)
        q = q.to(tl.float16)
    if start >= seq_len:
        zero = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        if SINGLE_SPLIT or FUSED_REDUCE:
            # Only the sequence's active partitions take part; a sequence of
            # length 0 (padding) still gets a defined output, from split 0.
            if split == 0:
                tl.store(o_rows, zero.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        else:
            # An empty partition leaves defined values for the reduce kernel:
            # weight zero, so it needs no per-sequence length.
            _store_partial(part_out_ptr, part_lse_ptr, toks_q, heads, split, dims, row_mask, zero,
                           tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32),
                           stride_po_seq, stride_po_head, stride_po_split,
                           stride_pl_seq, stride_pl_head)
        return
    end = tl.minimum(start + partition_size, seq_len)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_off = kv_head * stride_cache_head
    # Every tile holds at least one token < seq_len, so m_i is finite after the first.
    for tile in range(start, end, BLOCK_N):
        toks = tile + tl.arange(0, BLOCK_N)
        tok_mask = toks < end
        block = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        offs = (block * stride_cache_block + (toks % BLOCK_SIZE) * stride_cache_slot
                + head_off)[:, None] + dims[None, :]
        # An FP8 cache's values widen (exactly) to the products' dtype, q's.
        k = tl.load(key_cache_ptr + offs, mask=tok_mask[:, None], other=0.0).to(q.dtype)
        if not VALUES_AFTER_SCORES:
            v = tl.load(value_cache_ptr + offs, mask=tok_mask[:, None], other=0.0).to(q.dtype)
        s = mma(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * scale_log2
        if QLEN > 1:  # causal: row t sees the tokens up to seq_len - QLEN + t
            limit = seq_len - QLEN + 1 + rows // GROUP
            s = tl.where(tok_mask[None, :] & (toks[None, :] < limit[:, None]), s, float("-inf"))
            # A row may see none of a partition near the end: keep its sums at zero, not NaN.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            s = tl.where(tok_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if VALUES_AFTER_SCORES:
            v = tl.load(value_cache_ptr + offs, mask=tok_mask[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    if QLEN > 1:
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    else:
        acc = acc / l_i[:, None]
    if SINGLE_SPLIT:
        tl.store(o_rows, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    elif FUSED_REDUCE:
        num_active = tl.cdiv(seq_len, partition_size)
        if num_active == 1:  # the whole context was this partition's
            tl.store(o_rows, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        else:
            _store_partial(part_out_ptr, part_lse_ptr, toks_q, heads, split, dims, row_mask, acc,
                           m_i + tl.log2(l_i), stride_po_seq, stride_po_head, stride_po_split,
                           stride_pl_seq, stride_pl_head)
            # Every thread's stores above are ordered before the one thread's
            # atomic by the barrier; acq_rel at GPU scope publishes them to the
            # program that sees the final count, and gives it the others'.
            tl.debug_barrier()
            counter = counters_ptr + seq * num_kv_heads + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_active - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call
                for t in tl.static_range(QLEN):
                    _combine_partitions(part_out_ptr, part_lse_ptr, out_ptr, seq * QLEN + t, kv_head, num_active,
                                        stride_po_seq, stride_po_head, stride_po_split,
                                        stride_pl_seq, stride_pl_head, stride_o_tok, stride_o_head,
                                        GROUP, GROUP_P2, HEAD_DIM, SPLIT_CHUNK)
    else:
        _store_partial(part_out_ptr, part_lse_ptr, toks_q, heads, split, dims, row_mask, acc,
                       m_i + tl.log2(l_i), stride_po_seq, stride_po_head, stride_po_split,
                       stride_pl_seq, stride_pl_head)


@triton.jit
def _store_partial(part_out_ptr, part_lse_ptr, toks, heads, split, dims, row_mask, out, lse,
                   stride_po_seq, stride_po_head, stride_po_split, stride_pl_seq, stride_pl_head):
    """One partition's result for the rows (query token `toks`, head
    `heads`): normalised output [rows, head_dim] and log-sum-exp (base 2)
    [rows], fp32."""
    po = (part_out_ptr + toks[:, None] * stride_po_seq + heads[:, None] * stride_po_head
          + split * stride_po_split + dims[None, :])
    tl.store(po, out, mask=row_mask[:, None])
    pl = part_lse_ptr + toks * stride_pl_seq + heads * stride_pl_head + split
    tl.store(pl, lse, mask=row_mask)


@triton.jit
def _combine_partitions(part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, num_active,
                        stride_po_seq, stride_po_head, stride_po_split,
                        stride_pl_seq, stride_pl_head, stride_o_tok, stride_o_head,
                        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                        SPLIT_CHUNK: tl.constexpr):
    """out[seq, heads of kv_head] from the num_active partial results (online
    log-sum-exp over chunks of splits). Loads go to L2 (.cg): the partials
    were written by other programs during this launch."""
    rows = tl.arange(0, GROUP_P2)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    lse_rows = part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + heads * stride_pl_head
    po_rows = part_out_ptr + seq.to(tl.int64) * stride_po_seq + heads * stride_po_head
    m = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], dtype=tl.float32)
    for chunk in range(0, num_active, SPLIT_CHUNK):
        idx = chunk + tl.arange(0, SPLIT_CHUNK)
        valid = row_mask[:, None] & (idx < num_active)[None, :]
        lse = tl.load(lse_rows[:, None] + idx[None, :], mask=valid, other=float("-inf"),
                      cache_modifier=".cg")
        part = tl.load(po_rows[:, None, None] + idx[None, :, None] * stride_po_split
                       + dims[None, None, :], mask=valid[:, :, None], other=0.0,
                       cache_modifier=".cg")
        # Padding rows (row_mask false) see only -inf; keep their arithmetic finite.
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe[:, None])
        total = total * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], axis=1)
        m = m_new
    result = acc / tl.maximum(total, 1e-30)[:, None]
    o = out_ptr + seq.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(o, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit(do_not_specialize=_VARYING_REDUCE_ARGS)
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    stride_o_tok, stride_o_head,
    num_splits,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLIT_CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # Every one of the grid's num_splits partitions wrote its (lse, output), -inf
    # and zeros when empty, so nothing here waits on seq_lens: the loads of lse
    # and of the partial outputs go out together, one round trip to memory.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    lse_row = part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + head * stride_pl_head
    po_row = part_out_ptr + seq.to(tl.int64) * stride_po_seq + head * stride_po_head
    if SPLITS_PAD <= SPLIT_CHUNK:
        idx = tl.arange(0, SPLITS_PAD)
        valid = idx < num_splits
        lse = tl.load(lse_row + idx, mask=valid, other=float("-inf"))
        part = tl.load(po_row + idx[:, None] * stride_po_split + dims[None, :],
                       mask=valid[:, None], other=0.0)
        lse_max = tl.max(lse, axis=0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all empty: weights 0
        w = tl.exp2(lse - lse_max)
        total = tl.sum(w, axis=0)
        acc = tl.sum(part * w[:, None], axis=0)
    else:
        splits = tl.arange(0, SPLITS_PAD)
        lse = tl.load(lse_row + splits, mask=splits < num_splits, other=float("-inf"))
        lse_max = tl.max(lse, axis=0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        total = tl.sum(tl.exp2(lse - lse_max), axis=0)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for chunk in range(0, num_splits, SPLIT_CHUNK):
            idx = chunk + tl.arange(0, SPLIT_CHUNK)
            valid = idx < num_splits
            w = tl.exp2(tl.load(lse_row + idx, mask=valid, other=float("-inf")) - lse_max)
            part = tl.load(po_row + idx[:, None] * stride_po_split + dims[None, :],
                           mask=valid[:, None], other=0.0)
            acc += tl.sum(part * w[:, None], axis=0)
    # total is 0 only for a sequence of length 0 (padding): write zeros, not NaN.
    result = tl.where(total > 0, acc / tl.maximum(total, 1e-30), 0.0)
    o = out_ptr + seq.to(tl.int64) * stride_o_tok + head * stride_o_head + dims
    tl.store(o, result.to(out_ptr.dtype.element_ty))


def _combine_chunk(splits_pad: int, group: int, head_dim: int, num_warps: int) -> int:
    """Splits combined per step in the fused path: [group, chunk, head_dim] fp32
    values are live at once, kept to 64 registers a thread (8K at 4 warps)."""
    group_p2 = max(2, triton.next_power_of_2(group))
    fit = max(2, 64 * 32 * num_warps // (group_p2 * head_dim))
    fit = 1 << (fit.bit_length() - 1)  # a power of two, as tl.arange needs
    return max(2, min(splits_pad, 16, fit))


@dataclass(frozen=True)
class DecodeChoices:
    """The compile-time choices of one decode call: each distinct value is a
    kernel variant Triton compiles (engine/kernel_warmup.py warms them all)."""

    single: bool  # one split: the partition kernel writes the output itself
    fused: bool  # 2..fused_max_splits splits, combined inside the launch
    split_chunk: int  # the partition kernel's SPLIT_CHUNK (read only when fused; else 2)
    reduce_splits_pad: int  # the reduce kernel's SPLITS_PAD (0: no reduce launch)
    reduce_chunk: int  # the reduce kernel's SPLIT_CHUNK (0: no reduce launch)
    block_n: int  # KV tokens a tile


def num_splits_of(max_seq_len: int, partition_size: int) -> int:
    """The grid's split count: enough partitions for the longest context."""
    return max(1, triton.cdiv(max_seq_len, partition_size))


def decode_choices(num_splits: int, group: int, head_dim: int, reduce_chunk: int,
                   fused_max_splits: int, num_warps: int, block_n: int) -> DecodeChoices:
    single = num_splits == 1
    fused = 1 < num_splits <= fused_max_splits
    splits_pad = triton.next_power_of_2(num_splits)
    reduced = not single and not fused
    # One value where the kernel does not read it: another would be another variant.
    split_chunk = min(reduce_chunk, _combine_chunk(splits_pad, group, head_dim, num_warps)) if fused else 2
    return DecodeChoices(single, fused, split_chunk,
                         splits_pad if reduced else 0, min(reduce_chunk, splits_pad) if reduced else 0, block_n)


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                     scale: float, out: torch.Tensor, *, partition_size: int, block_n: int,
                     num_warps: int = 4, num_stages: int = 2, reduce_chunk: int = 64,
                     fused_max_splits: int = 0, query_len: int = 1, heads_first: bool = False,
                     values_after_scores: bool = False) -> torch.Tensor:
    """out[i] = attention of query[i] ([num_heads, head_dim]) over sequence i's context.

    query_len > 1: every sequence has that many query tokens, its last ones,
    rows s * query_len .. (s + 1) * query_len - 1 of query and out, each
    attending causally (a verifying step's 1 + k rows).

    key_cache/value_cache are [num_blocks, block_size, num_kv_heads, head_dim].
    partition_size: with max_seq_len, sets the grid's split count
    (num_splits_of); each sequence then spreads its own context over those
    splits (module docstring).
    fused_max_splits: with up to this many splits the partitions are combined
    inside the one launch (through split_counters), with more by a second kernel.
    reduce_chunk: at most this many partial results combined per loop step
    (a power of two). Each step is a dependent round trip to memory, on the
    critical path at small batch.
    heads_first, values_after_scores: the kernel's HEADS_FIRST and
    VALUES_AFTER_SCORES (grid order; when a tile's values are loaded).
    The caches may have any strides but a dense head_dim: a heads-outer
    cache ([num_blocks, num_kv_heads, block_size, head_dim] in memory) is
    passed as a view shaped [num_blocks, block_size, num_kv_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = num_tokens // query_len
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    assert partition_size % block_n == 0, (partition_size, block_n)
    num_splits = num_splits_of(max_seq_len, partition_size)
    choices = decode_choices(num_splits, group, head_dim, reduce_chunk, fused_max_splits, num_warps, block_n)
    single, fused = choices.single, choices.fused
    # The kernel takes a pointer either way; it reads this one only when fused.
    counters = split_counters(query.device, num_seqs * num_kv_heads) if fused else seq_lens
    if single:  # the partition kernel normalises and writes out directly
        part_out = part_lse = out
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim,
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                               device=query.device)
        po_strides = part_out.stride()[:3]
        pl_strides = part_lse.stride()[:2]
    pdl = pdl_launch(query)
    if heads_first and num_seqs > 65535:  # CUDA's limit on a grid's second dimension
        raise ValueError(f"decode attention with heads_first takes at most 65535 sequences, got {num_seqs}")
    grid = (num_kv_heads, num_seqs, num_splits) if heads_first else (num_seqs, num_kv_heads, num_splits)
    _decode_partition_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, out, part_out, part_lse,
        counters,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *po_strides, *pl_strides,
        num_kv_heads,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group * query_len)),
        GROUP_P2=max(2, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SINGLE_SPLIT=single, FUSED_REDUCE=fused,
        SPLIT_CHUNK=choices.split_chunk,
        **dot_settings(query.dtype), FP16_PRODUCTS=fp16_products(query.dtype, key_cache.dtype), **pdl,
        QLEN=query_len, HEADS_FIRST=heads_first, VALUES_AFTER_SCORES=values_after_scores,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not single and not fused:
        _decode_reduce_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out,
            *po_strides, *pl_strides,
            out.stride(0), out.stride(1),
            num_splits,
            HEAD_DIM=head_dim, SPLITS_PAD=choices.reduce_splits_pad,
            SPLIT_CHUNK=choices.reduce_chunk, **pdl,
            num_warps=4,
        )
    return out
