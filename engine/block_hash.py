"""Chained block hashes: hash(block i) = H(hash(block i-1), tokens of block i, extra keys).

The same hashes name a block in the local prefix cache, on the wire and in the
KV store, so a block computed anywhere can be found everywhere. sha256 (not
Python's salted hash()) keeps them equal across processes and machines.
"""
from __future__ import annotations

import functools
import struct
from hashlib import sha256
from typing import Optional, Sequence

from tandem.engine.block_pool import BlockHash


_NO_PARENT = b"\0" * 32


def hash_block(parent: Optional[BlockHash], token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    # sha256 over parent + tokens as little-endian int64 + extra, in one call:
    # the scheduler names blocks as decodes fill them, so this is on every
    # step's path. The bytes hashed are fixed: stored blocks are found by them.
    return sha256(b"".join((parent or _NO_PARENT, _packer(len(token_ids)).pack(*token_ids), extra))).digest()


@functools.lru_cache(maxsize=None)
def _packer(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}q")


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra: bytes = b"") -> list[BlockHash]:
    """Append the hashes of blocks that became full since `hashes` was last extended."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
    return hashes
