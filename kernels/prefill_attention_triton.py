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
runs over BLOCK_N-token KV tiles up to the last position the rows can see:
the cached prefix first, gathered through the block table, then the step's
own tokens, causally. Those are gathered too, or, given `new_kv` (prompt
launches on Hopper), loaded through tensor descriptors (TMA) from the key
and value rows the projection wrote, which skips the gather's per-element
addressing.
Tiles beyond a sequence's rows exit at once, so the grid may be sized by
meta.max_query_len.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

try:  # Triton 3.4 and later
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

from tandem.kernels.common_triton import dot_settings, fp16_products, mma

LOG2E = 1.4426950408889634


@triton.jit
def _gather_kv_tile(key_cache_ptr, value_cache_ptr, bt_row, pos, valid, stride_cache_block,
                    stride_cache_slot, head_off, dims, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The K and V rows at positions `pos` of one sequence, through its block
    table; MASKED: rows where `valid` is false read as zeros."""
    if MASKED:
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
    offs = (block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
            + head_off)[:, None] + dims[None, :]
    if MASKED:
        k = tl.load(key_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(value_cache_ptr + offs, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(key_cache_ptr + offs)
        v = tl.load(value_cache_ptr + offs)
    return k, v


@triton.jit
def _online_softmax_step(q, k, v, m_i, l_i, acc, visible, scale_log2, MASKED: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """(m_i, l_i, acc) after one KV tile. MASKED: only scores where `visible`
    [BLOCK_M, BLOCK_N] holds count; otherwise every row sees the whole tile
    and no mask is built. m_i is in units of scaled scores (s * scale_log2),
    so that a score costs one fused multiply-add before its exp2."""
    # An FP8 cache's tiles widen (exactly) to the products' dtype, q's.
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = mma(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST)
    if MASKED:  # -inf stays -inf once scaled (scale_log2 > 0), and exp2 makes it 0
        s = tl.where(visible, s, float("-inf"))
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
    q_ptr, key_cache_ptr, value_cache_ptr, key_desc, value_desc, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, out_ptr,
    scale_log2,
    stride_q_tok, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NEW_KV_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, FP16_PRODUCTS: tl.constexpr,
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
    dims = tl.arange(0, HEAD_DIM)
    tok = (q_begin + token).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    q_off = tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)
    if FP16_PRODUCTS:  # an FP8 cache (common_triton.fp16_products)
        q = q.to(tl.float16)

    head_off = kv_head * stride_cache_head
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # The cached prefix: every row sees all of it, so only its last tile, where
    # it may end mid-tile, needs a mask.
    whole_prefix_end = prefix_len // BLOCK_N * BLOCK_N
    for tile in range(0, whole_prefix_end, BLOCK_N):
        k, v = _gather_kv_tile(key_cache_ptr, value_cache_ptr, bt_row, tile + offs_n, None,
                               stride_cache_block, stride_cache_slot, head_off, dims, BLOCK_SIZE, False)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, None, scale_log2, False,
                                             DOT_PRECISION, DOT_UPCAST)
    if whole_prefix_end < prefix_len:
        pos = whole_prefix_end + offs_n
        valid = pos < prefix_len
        k, v = _gather_kv_tile(key_cache_ptr, value_cache_ptr, bt_row, pos, valid,
                               stride_cache_block, stride_cache_slot, head_off, dims, BLOCK_SIZE, True)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, valid[None, :], scale_log2, True,
                                             DOT_PRECISION, DOT_UPCAST)

    # This step's own tokens, causally: new token j sits at position prefix_len + j.
    # Every row sees token 0, so after the first tile each m_i is finite and a
    # row fully masked in a later tile contributes exp2(-inf) = 0.
    # NEW_KV_TMA: their K/V come from the step's own key/value rows through
    # tensor descriptors (TMA on Hopper) instead of gathers through the block
    # table (docs/kernels.md, version 9).
    end_tok = tl.minimum((first_row + BLOCK_M - 1) // GROUP + 1, q_len)  # the tile's last row's token + 1
    # Tokens wholly before the tile's first row's own are seen by every row: no mask.
    unmasked_end = (first_row // GROUP + 1) // BLOCK_N * BLOCK_N
    for j0 in range(0, unmasked_end, BLOCK_N):
        if NEW_KV_TMA:
            k = key_desc.load([q_begin + j0, kv_head * HEAD_DIM])
            v = value_desc.load([q_begin + j0, kv_head * HEAD_DIM])
        else:
            k, v = _gather_kv_tile(key_cache_ptr, value_cache_ptr, bt_row, prefix_len + j0 + offs_n, None,
                                   stride_cache_block, stride_cache_slot, head_off, dims, BLOCK_SIZE, False)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, None, scale_log2, False,
                                             DOT_PRECISION, DOT_UPCAST)
    for j0 in range(unmasked_end, end_tok, BLOCK_N):
        j = j0 + offs_n
        valid = j < end_tok
        if NEW_KV_TMA:
            # Rows past the sequence belong to the next one (or lie past the
            # tensor, read as zeros): masked out of the scores, and V zeroed so
            # that no junk value can turn a zero weight into NaN.
            k = key_desc.load([q_begin + j0, kv_head * HEAD_DIM])
            v = value_desc.load([q_begin + j0, kv_head * HEAD_DIM])
            v = tl.where(valid[:, None], v, 0.0)
        else:
            k, v = _gather_kv_tile(key_cache_ptr, value_cache_ptr, bt_row, prefix_len + j, valid,
                                   stride_cache_block, stride_cache_slot, head_off, dims, BLOCK_SIZE, True)
        visible = valid[None, :] & (j[None, :] <= token[:, None])
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, visible, scale_log2, True,
                                             DOT_PRECISION, DOT_UPCAST)

    acc = acc / l_i[:, None]
    o = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def tma_rows_usable(rows: torch.Tensor) -> bool:
    """Whether a [num_tokens, num_kv_heads, head_dim] tensor of K or V rows
    (a view of a fused projection's output is fine) can be read through a
    tensor descriptor: a GPU with TMA (Hopper or later), or the CPU
    interpreter, which emulates descriptors; the heads of a row side by
    side; the row stride and base 16-byte aligned, as TMA requires."""
    if TensorDescriptor is None or rows.dim() != 3:
        return False
    if rows.is_cuda and not _has_tma(rows.device):
        return False
    size = rows.element_size()
    return (rows.stride(2) == 1 and rows.stride(1) == rows.shape[2] and rows.shape[2] * size >= 16
            and (rows.stride(0) * size) % 16 == 0 and rows.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _row_tiles(rows: torch.Tensor, block_n: int):
    """A descriptor over rows viewed as [num_tokens, num_kv_heads * head_dim]
    that loads [block_n, head_dim] tiles: block_n tokens of one KV head."""
    tokens, heads, head_dim = rows.shape
    return TensorDescriptor(rows, [tokens, heads * head_dim], [rows.stride(0), 1], [block_n, head_dim])


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                      out: torch.Tensor, *, block_m: int, block_n: int, num_warps: int = 4,
                      num_stages: int = 2,
                      new_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """out = attention of the flattened query [num_tokens, num_heads, head_dim].

    key_cache/value_cache are [num_blocks, block_size, num_kv_heads, head_dim].
    new_kv: this step's own key and value rows [num_tokens, num_kv_heads,
    head_dim], the ones just written to the cache, each passing
    tma_rows_usable; given, the new tokens' tiles are read from them through
    tensor descriptors rather than gathered through the block table (the
    cached prefix always is).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    grid = (triton.cdiv(max(max_query_len, 1) * group, block_m), num_seqs, num_kv_heads)
    key_desc = value_desc = None
    if new_kv is not None:
        key_desc, value_desc = (_row_tiles(rows, block_n) for rows in new_kv)
    _prefill_kernel[grid](
        query, key_cache, value_cache, key_desc, value_desc, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, NEW_KV_TMA=new_kv is not None,
        **dot_settings(query.dtype), FP16_PRODUCTS=fp16_products(query.dtype, key_cache.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
