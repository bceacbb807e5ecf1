"""Plain-torch twins of the paged attention ops: the CPU path and the test oracle.

Clarity over speed: one sequence at a time, gathering its context from the
block table. Accumulation is in float32 whatever the cache dtype (an FP8
cache's values are widened to float32 as they are read).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.kv_cache_dtype import movable, to_cache_dtype
from tandem.kernels.metadata import AttentionMetadata


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots.

    Slots < 0 mark padding tokens and are skipped. An FP8 cache stores them
    divided by k_scale / v_scale, rounded and clamped (kv_cache_dtype.py);
    other caches ignore the scales.
    """
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    key, value = to_cache_dtype(key, kv_cache.dtype, k_scale), to_cache_dtype(value, kv_cache.dtype, v_scale)
    if kv_cache.is_contiguous():  # the engine's tokens-outer blocks: slots are rows of one flat view
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        movable(flat[0]).index_copy_(0, slot_mapping, movable(key))
        movable(flat[1]).index_copy_(0, slot_mapping, movable(value))
        return
    # Heads-outer blocks (--kv-cache-layout HND, a transposed view): by block and place in it.
    block_size = kv_cache.shape[2]
    blocks, places = slot_mapping // block_size, slot_mapping % block_size
    movable(kv_cache[0]).index_put_((blocks, places), movable(key))
    movable(kv_cache[1]).index_put_((blocks, places), movable(value))


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [seq_len, num_kv_heads, head_dim] of one sequence."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    k = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


# Queries per attention call in a prefill: the scores of one call are
# [heads, QUERY_TILE, context], so a step's memory stays bounded by the token
# budget and the context, not by the square of the prompt's length.
QUERY_TILE = 256


def paged_attention_torch(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float) -> torch.Tensor:
    """Attention of query [num_tokens, num_heads, head_dim] over the paged cache.

    The new tokens' K/V must already be in the cache (write_kv first).
    """
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        qs, qe = starts[i], starts[i + 1]
        q_len = qe - qs
        if q_len == 0 or seq_len == 0:
            continue
        k, v = gather_context(kv_cache, meta.block_tables[i], seq_len)
        k = k.transpose(0, 1).float().repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        first_position = seq_len - q_len  # of query qs
        for ts in range(0, q_len, QUERY_TILE):
            te = min(q_len, ts + QUERY_TILE)
            q = query[qs + ts:qs + te].transpose(0, 1).float()  # [H, tile, D]
            # Causal: the tile sees keys up to its last query's position.
            visible = first_position + te
            mask = None
            if te - ts > 1:
                positions = torch.arange(first_position + ts, visible, device=query.device).unsqueeze(1)
                mask = torch.arange(visible, device=query.device).unsqueeze(0) <= positions  # [tile, visible]
            o = F.scaled_dot_product_attention(q, k[:, :visible], v[:, :visible], attn_mask=mask,
                                               scale=scale)
            out[qs + ts:qs + te] = o.transpose(0, 1).to(query.dtype)
    return out


def paged_attention_torch_batched(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                                  scale: float) -> torch.Tensor:
    """The CPU serving path: every decode (one query token) of the batch in one
    attention call over contexts padded to the longest; prefill sequences one
    at a time (their cost is in the arithmetic, not the call count).

    Same function as paged_attention_torch, which stays the oracle.
    """
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(seq_lens))]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if len(decodes) < 2:
        return paged_attention_torch(query, kv_cache, meta, scale)
    out = torch.empty_like(query)
    block_size = kv_cache.shape[2]
    dev = query.device  # the CPU lists become tensors where the cache lives
    lens = torch.tensor([seq_lens[i] for i in decodes], device=dev)
    max_len = int(lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    rows = torch.tensor(decodes, device=dev)
    tables = meta.block_tables[rows, :num_blocks].long()  # [B, nb]
    k = kv_cache[0][tables].flatten(1, 2)[:, :max_len]  # [B, L, Hkv, D]
    v = kv_cache[1][tables].flatten(1, 2)[:, :max_len]
    q_rows = torch.tensor([starts[i] for i in decodes], device=dev)
    q = query[q_rows].unsqueeze(2).float()  # [B, H, 1, D]
    mask = (torch.arange(max_len, device=dev).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    out[q_rows] = o.squeeze(2).to(query.dtype)
    prefills = [i for i, n in enumerate(q_lens) if n > 1]
    if prefills:
        # reuse the oracle on a metadata view holding only the prefill sequences
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping, query_start_loc=meta.query_start_loc,
            seq_lens=meta.seq_lens, block_tables=meta.block_tables, max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len, query_start_loc_cpu=starts,
            seq_lens_cpu=[seq_lens[i] if q_lens[i] > 1 else 0 for i in range(len(seq_lens))])
        partial = paged_attention_torch(query, kv_cache, sub, scale)
        for i in prefills:
            out[starts[i]:starts[i + 1]] = partial[starts[i]:starts[i + 1]]
    return out
