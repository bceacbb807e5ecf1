"""The CPU serving path of paged attention equals the per-sequence oracle, and
the oracle equals dense causal attention computed without any paging."""
import random

import pytest
import torch

from tandem.kernels.metadata import AttentionMetadata
from tandem.kernels.paged_attention_torch import (paged_attention_torch, paged_attention_torch_batched,
                                                  write_kv_torch)


def random_batch(q_lens, ctx_lens, heads=6, kv_heads=2, dim=16, block=16, num_blocks=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cache = torch.randn(2, num_blocks, block, kv_heads, dim, generator=g)
    free = list(range(1, num_blocks))
    rng.shuffle(free)  # non-contiguous, shuffled block ids
    tables, slots, dense_k, dense_v = [], [], [], []
    max_blocks = max((c + block - 1) // block for c in ctx_lens)
    for q_len, ctx in zip(q_lens, ctx_lens):
        blocks = [free.pop() for _ in range((ctx + block - 1) // block)]
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        slots += [blocks[p // block] * block + p % block for p in range(ctx - q_len, ctx)]
    total_q = sum(q_lens)
    query = torch.randn(total_q, heads, dim, generator=g)
    key = torch.randn(total_q, kv_heads, dim, generator=g)
    value = torch.randn(total_q, kv_heads, dim, generator=g)
    write_kv_torch(key, value, cache, torch.tensor(slots))
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(starts, dtype=torch.int32),
                             torch.tensor(ctx_lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
                             max(q_lens), max(ctx_lens), starts, list(ctx_lens))
    return query, cache, meta


@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1, 1, 1, 1], [1, 17, 40, 100]),  # decodes only
    ([1, 5, 1, 30, 1], [33, 5, 64, 90, 2]),  # mixed: prefill with and without cached prefix
    ([12], [12]),
])
def test_batched_path_equals_oracle(q_lens, ctx_lens):
    query, cache, meta = random_batch(q_lens, ctx_lens)
    a = paged_attention_torch(query, cache, meta, 0.25)
    b = paged_attention_torch_batched(query, cache, meta, 0.25)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_oracle_equals_dense_causal_attention():
    query, cache, meta = random_batch([7], [20], heads=4, kv_heads=2)
    out = paged_attention_torch(query, cache, meta, 0.5)
    table = meta.block_tables[0].long()
    k = cache[0][table].flatten(0, 1)[:20]  # [20, kv, d]
    v = cache[1][table].flatten(0, 1)[:20]
    for j in range(7):
        pos = 13 + j
        for h in range(4):
            kh = k[: pos + 1, h // 2]
            w = torch.softmax((kh @ query[j, h]) * 0.5, dim=0)
            torch.testing.assert_close(out[j, h], w @ v[: pos + 1, h // 2], rtol=1e-5, atol=1e-5)
