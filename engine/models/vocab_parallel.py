"""The embedding table split by vocabulary across tensor-parallel ranks:
each rank holds a contiguous slice of token ids (engine/tensor_parallel.py's
vocab_shard), looks up the tokens that fall in it, writes zeros for the
others, and one all-reduce assembles every token's row."""
from __future__ import annotations

import torch
from torch import nn

from tandem.engine.tensor_parallel import all_reduce, vocab_shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.start, self.per_rank = vocab_shard(vocab_size)
        # named `weight` so that a tied LM head can share it (its rows are the same slice)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        rows = nn.functional.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        return all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))
