"""What an attention op needs to know about one flattened batch.

The KV cache of one layer is a tensor [2, num_blocks, block_size,
num_kv_heads, head_dim] (index 0 keys, 1 values). A token's slot is
block_id * block_size + offset; block_tables[i, j] is the physical block that
holds tokens [j*block_size, (j+1)*block_size) of sequence i.

The batch is flattened: the new (query) tokens of sequence i are rows
query_start_loc[i] : query_start_loc[i+1] of the query tensor, and they are
the last tokens of its context of seq_lens[i] tokens. Query token j of
sequence i sits at position seq_lens[i] - q_len_i + j and attends causally to
every context token up to and including its own position: the cached prefix
in full, the new tokens causally. A decode is q_len 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 for padding tokens (not written)
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    max_query_len: int
    max_seq_len: int
    # Host copies, so the torch twins need no device->host sync per layer.
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Every sequence has exactly max_query_len query tokens (a verifying
    # graph's 1 + k rows each): the Triton path may then run the split decode
    # kernel over them (attention_triton). Set only where the batch is built
    # so, and its kernel variants compile before serving (graph capture).
    uniform_queries: bool = False

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
