"""Plain-torch twins of the paged attention ops: the CPU path and the test oracle.

Clarity over speed: one sequence at a time, gathering its context from the
block table. Accumulation is in float32 whatever the cache dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.metadata import AttentionMetadata


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots.

    Slots < 0 mark padding tokens and are skipped.
    """
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [seq_len, num_kv_heads, head_dim] of one sequence."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    k = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


def paged_attention_torch(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float) -> torch.Tensor:
    """Attention of query [num_tokens, num_heads, head_dim] over the paged cache.

    The new tokens' K/V must already be in the cache (write_kv first).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        qs, qe = starts[i], starts[i + 1]
        q_len = qe - qs
        if q_len == 0:
            continue
        k, v = gather_context(kv_cache, meta.block_tables[i], seq_len)
        q = query[qs:qe].transpose(0, 1).float()  # [H, q_len, D]
        k = k.transpose(0, 1).float().repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        mask = None
        if q_len > 1:
            positions = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            mask = torch.arange(seq_len).unsqueeze(0) <= positions  # [q_len, L]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[qs:qe] = o.transpose(0, 1).to(query.dtype)
    return out
