"""Chained block hashes: hash(block i) = H(hash(block i-1), tokens of block i, extra keys).

The same hashes name a block in the local prefix cache, on the wire and in the
KV store, so a block computed anywhere can be found everywhere. sha256 (not
Python's salted hash()) keeps them equal across processes and machines.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

from tandem.engine.block_pool import BlockHash


def hash_block(parent: Optional[BlockHash], token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra: bytes = b"") -> list[BlockHash]:
    """Append the hashes of blocks that became full since `hashes` was last extended."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
    return hashes
