"""Split-KV ("flash-decoding") attention for batches of one query token per sequence.

Decode reads each sequence's whole KV context for one query token: the work
is memory bound and, at small batch, a grid of one program per (sequence, KV
head) leaves most of the GPU idle. So the context is cut into partitions of
`partition_size` tokens; program (seq, kv_head, split) computes attention of
all query heads that share the KV head (GQA: the KV tile is read once for the
whole group) over its partition, and writes a partial result: the
partition's normalised output and its log-sum-exp (base 2). A second
kernel combines the partitions of each (seq, head) by their log-sum-exps.

Invariants: partition_size is a multiple of BLOCK_N; a partition that starts
at or beyond its sequence's length is empty and writes log-sum-exp -inf (weight
0) and a zero output, so grids may be sized for meta.max_seq_len or any bound
above it (as a CUDA graph captured for the longest context needs). No host
syncs: every grid size is a host-side int.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common_triton import dot_settings, mma

LOG2E = 1.4426950408889634


@triton.jit
def _decode_partition_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,
    stride_q_tok, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    partition_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    rows = tl.arange(0, GROUP_PAD)  # query heads of this KV head, padded for tl.dot
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    if start >= seq_len:
        # An empty partition (its sequence is shorter than the grid's bound) still
        # leaves defined values: weight zero for the reduce, zeros for a padding
        # sequence of length 0, so the reduce needs no per-sequence length.
        zero = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        if SINGLE_SPLIT:
            o = (out_ptr + seq.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head
                 + dims[None, :])
            tl.store(o, zero.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        else:
            po = (part_out_ptr + seq.to(tl.int64) * stride_po_seq
                  + heads[:, None] * stride_po_head + split * stride_po_split + dims[None, :])
            tl.store(po, zero, mask=row_mask[:, None])
            pl = part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + heads * stride_pl_head + split
            tl.store(pl, tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32), mask=row_mask)
        return
    end = tl.minimum(start + partition_size, seq_len)

    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head
                + dims[None, :], mask=row_mask[:, None], other=0.0)

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
        k = tl.load(key_cache_ptr + offs, mask=tok_mask[:, None], other=0.0)
        v = tl.load(value_cache_ptr + offs, mask=tok_mask[:, None], other=0.0)
        s = mma(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * scale_log2
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    acc = acc / l_i[:, None]
    if SINGLE_SPLIT:
        o = out_ptr + seq.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        po = (part_out_ptr + seq.to(tl.int64) * stride_po_seq + heads[:, None] * stride_po_head
              + split * stride_po_split + dims[None, :])
        tl.store(po, acc, mask=row_mask[:, None])
        pl = part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + heads * stride_pl_head + split
        tl.store(pl, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    stride_o_tok, stride_o_head,
    num_splits,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
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


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                     scale: float, out: torch.Tensor, *, partition_size: int, block_n: int,
                     num_warps: int = 4, num_stages: int = 2,
                     reduce_chunk: int = 64) -> torch.Tensor:
    """out[i] = attention of query[i] ([num_heads, head_dim]) over sequence i's context.

    key_cache/value_cache are [num_blocks, block_size, num_kv_heads, head_dim].
    reduce_chunk: partial results the reduce combines per loop step. Each step
    is a dependent round trip to memory, on the critical path at small batch.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    assert partition_size % block_n == 0, (partition_size, block_n)
    num_splits = max(1, triton.cdiv(max_seq_len, partition_size))
    single = num_splits == 1
    if single:  # the partition kernel normalises and writes out directly
        part_out = part_lse = out
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim,
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                               device=query.device)
        po_strides = part_out.stride()[:3]
        pl_strides = part_lse.stride()[:2]
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *po_strides, *pl_strides,
        partition_size,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SINGLE_SPLIT=single,
        **dot_settings(query.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    if not single:
        splits_pad = triton.next_power_of_2(num_splits)
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out,
            *po_strides, *pl_strides,
            out.stride(0), out.stride(1),
            num_splits,
            HEAD_DIM=head_dim, SPLITS_PAD=splits_pad,
            SPLIT_CHUNK=min(reduce_chunk, splits_pad),
            num_warps=4,
        )
    return out
