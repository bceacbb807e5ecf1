"""Attention over the paged cache for a flattened batch of variable-length queries.

Serves prefill, chunked prefill, prefix-cache hits and mixed batches (a
decode is a query of length one). Query token j of sequence i sits at
position seq_len_i - q_len_i + j: it sees the cached prefix in full and the
new tokens causally, which is one rule, kv_pos <= q_pos.

Program (row_tile, seq, kv_head) computes BLOCK_M rows, each a (query token,
query head) pair of the GQA group that shares kv_head: row r is token r //
GROUP, head r % GROUP. So every KV tile gathered through the block table
serves the whole group (GROUP times fewer KV reads than a program per query
head, which matters for the decodes of a mixed batch), and an online softmax
runs over BLOCK_N-token KV tiles up to the last position the rows can see.
Tiles beyond a sequence's rows exit at once, so the grid may be sized by
meta.max_query_len.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common_triton import dot_settings, mma

LOG2E = 1.4426950408889634


@triton.jit
def _attend_kv_tile(q, m_i, l_i, acc, tile, end, q_pos, bt_row, key_cache_ptr, value_cache_ptr,
                    stride_cache_block, stride_cache_slot, head_off, dims, scale_log2,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """The online softmax over the KV tile at `tile`: (m_i, l_i, acc) after it.
    MASKED: the tile may reach past `end` or past some rows' own positions
    (the diagonal); otherwise every row sees all of it and no mask is built.
    m_i is in units of scaled scores (s * scale_log2), so that a score costs
    one fused multiply-add before its exp2."""
    kv_pos = tile + tl.arange(0, BLOCK_N)
    if MASKED:
        kv_mask = kv_pos < end
        block = tl.load(bt_row + kv_pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + kv_pos // BLOCK_SIZE).to(tl.int64)
    offs = (block * stride_cache_block + (kv_pos % BLOCK_SIZE) * stride_cache_slot
            + head_off)[:, None] + dims[None, :]
    if MASKED:
        k = tl.load(key_cache_ptr + offs, mask=kv_mask[:, None], other=0.0)
        v = tl.load(value_cache_ptr + offs, mask=kv_mask[:, None], other=0.0)
    else:
        k = tl.load(key_cache_ptr + offs)
        v = tl.load(value_cache_ptr + offs)
    s = mma(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST)
    if MASKED:  # -inf stays -inf once scaled (scale_log2 > 0), and exp2 makes it 0
        s = tl.where(kv_mask[None, :] & (kv_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return m_new, l_i, acc


# The block table's width changes with the batch; specializing on it (1, a
# multiple of 16, other) would compile up to three variants mid-serving
# (engine/kernel_warmup.py). It offsets the row of scalar block ids only.
@triton.jit(do_not_specialize=["stride_bt_seq"])
def _prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, out_ptr,
    scale_log2,
    stride_q_tok, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # The longest row tiles first: under causal attention a tile's work grows
    # with its index, and starting the long ones early leaves short ones for
    # the last wave instead of a few long ones running alone.
    row_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    first_row = row_tile * BLOCK_M
    if first_row >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len  # tokens already in the cache before this step

    rows = first_row + tl.arange(0, BLOCK_M)
    token = rows // GROUP  # index among this sequence's new tokens
    row_mask = token < q_len
    q_pos = prefix_len + token
    dims = tl.arange(0, HEAD_DIM)
    tok = (q_begin + token).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    q_off = tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)

    head_off = kv_head * stride_cache_head
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # The last row of this tile sees positions up to prefix_len + its token index.
    end = prefix_len + tl.minimum((first_row + BLOCK_M - 1) // GROUP + 1, q_len)
    # Every row of the tile sees every position up to its first row's own: KV
    # tiles wholly before it need neither bounds nor causal masks (most of a
    # long prompt's tiles, and all of a prefix's).
    unmasked_end = (prefix_len + first_row // GROUP + 1) // BLOCK_N * BLOCK_N
    for tile in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_kv_tile(
            q, m_i, l_i, acc, tile, end, q_pos, bt_row, key_cache_ptr, value_cache_ptr,
            stride_cache_block, stride_cache_slot, head_off, dims, scale_log2,
            BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, DOT_UPCAST)
    # The diagonal: every row sees position 0, so once a tile has been seen each
    # m_i is finite and a fully masked row in a later tile contributes exp2(-inf) = 0.
    for tile in range(unmasked_end, end, BLOCK_N):
        m_i, l_i, acc = _attend_kv_tile(
            q, m_i, l_i, acc, tile, end, q_pos, bt_row, key_cache_ptr, value_cache_ptr,
            stride_cache_block, stride_cache_slot, head_off, dims, scale_log2,
            BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, DOT_UPCAST)

    acc = acc / l_i[:, None]
    o = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                      out: torch.Tensor, *, block_m: int, block_n: int, num_warps: int = 4,
                      num_stages: int = 2) -> torch.Tensor:
    """out = attention of the flattened query [num_tokens, num_heads, head_dim].

    key_cache/value_cache are [num_blocks, block_size, num_kv_heads, head_dim].
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    grid = (triton.cdiv(max(max_query_len, 1) * group, block_m), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        **dot_settings(query.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
