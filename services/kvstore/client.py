"""A blocking client of the KV store service, and the wire's chunking rule.

The engine's KV connector calls it from a background thread and treats any
failure as "the store has nothing for me": every gRPC error or missed deadline
becomes `KVStoreUnavailable`, and no call outlives `timeout_s`, so a dead store
costs a recompute, never a hung request.

    client = KVStoreClient("127.0.0.1:50081")
    client.put([("model/abc/0", block_bytes)])
    [value] = client.get(["model/abc/0"])
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import grpc

from tandem.services.common.grpc_server import TLSConfig, make_channel
from tandem.v1 import kvstore_pb2, kvstore_pb2_grpc

# Largest value bytes in one message, both directions. Well under the 16 MiB a
# peer with stricter limits might accept, big enough that a KV block of a
# small model (hundreds of KiB) travels in one message.
CHUNK_BYTES = 4 * 1024 * 1024
# Keys per Get/Exists/Delete call: keeps request messages small (keys are ~100 bytes).
KEYS_PER_CALL = 4096


def split_chunks(value: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, bool]]:
    """(chunk, more) pairs of one value; an empty value is one empty chunk."""
    if not value:
        yield b"", False
        return
    view = memoryview(value)
    for start in range(0, len(value), chunk_bytes):
        end = start + chunk_bytes
        yield bytes(view[start:end]), end < len(value)


class KVStoreUnavailable(Exception):
    """The store did not answer in time or answered with an error; `code` is the
    gRPC status code's name when there was one (e.g. "UNAVAILABLE")."""

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class StoreStats:
    backend: str
    bytes: int
    blocks: int
    capacity_bytes: int  # 0: unbounded
    hits: int
    misses: int
    evictions: int
    data_port: int = 0  # the bulk data channel's port on the store's host; 0: none


class KVStoreClient:
    """Thread-safe: gRPC channels and stubs may be shared between threads, and
    the client keeps no other mutable state."""

    def __init__(self, target: str, timeout_s: float = 10.0, tls: Optional[TLSConfig] = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.target = target
        self.timeout_s = timeout_s
        self._channel = make_channel(target, tls)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

    # --- calls ---------------------------------------------------------------------

    def put(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Store the values; returns how many were stored (a value larger than the
        store's capacity is refused)."""
        if not items:
            return 0
        for key, _ in items:
            if not key:
                raise ValueError("KV store keys must be non-empty strings")
        deadline = time.monotonic() + self.timeout_s

        def requests() -> Iterator[kvstore_pb2.PutRequest]:
            for key, value in items:
                for chunk, more in split_chunks(value):
                    yield kvstore_pb2.PutRequest(key=key, data=chunk, more=more)

        reply = self._call("put", deadline, lambda t: self._stub.Put(requests(), timeout=t))
        return reply.stored

    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """The value of each key, None where the store does not have it."""
        deadline = time.monotonic() + self.timeout_s
        out: list[Optional[bytes]] = []
        for start in range(0, len(keys), KEYS_PER_CALL):
            batch = list(keys[start:start + KEYS_PER_CALL])
            out.extend(self._call("get", deadline, lambda t: self._get_batch(batch, t)))
        return out

    def _get_batch(self, keys: list[str], timeout: float) -> list[Optional[bytes]]:
        # Replies come in request order; a value may span several messages.
        out: list[Optional[bytes]] = []
        parts: list[bytes] = []
        call = self._stub.Get(kvstore_pb2.GetRequest(keys=keys), timeout=timeout)
        for reply in call:
            if len(out) >= len(keys) or reply.key != keys[len(out)]:
                call.cancel()
                raise KVStoreUnavailable(
                    f"KV store at {self.target} answered Get out of order (got key {reply.key!r}); "
                    f"is it a tandem KV store of the same version?")
            if not reply.found:
                out.append(None)
                continue
            parts.append(reply.data)
            if not reply.more:
                out.append(b"".join(parts))
                parts = []
        if len(out) != len(keys):
            raise KVStoreUnavailable(
                f"KV store at {self.target} ended Get after {len(out)} of {len(keys)} keys")
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        deadline = time.monotonic() + self.timeout_s
        out: list[bool] = []
        for start in range(0, len(keys), KEYS_PER_CALL):
            request = kvstore_pb2.ExistsRequest(keys=list(keys[start:start + KEYS_PER_CALL]))
            reply = self._call("exists", deadline, lambda t: self._stub.Exists(request, timeout=t))
            out.extend(reply.present)
        return out

    def delete(self, keys: Sequence[str]) -> int:
        deadline = time.monotonic() + self.timeout_s
        deleted = 0
        for start in range(0, len(keys), KEYS_PER_CALL):
            request = kvstore_pb2.DeleteRequest(keys=list(keys[start:start + KEYS_PER_CALL]))
            deleted += self._call("delete", deadline, lambda t: self._stub.Delete(request, timeout=t)).deleted
        return deleted

    def stats(self) -> StoreStats:
        deadline = time.monotonic() + self.timeout_s
        r = self._call("stats", deadline, lambda t: self._stub.Stats(kvstore_pb2.StatsRequest(), timeout=t))
        return StoreStats(backend=r.backend, bytes=r.bytes, blocks=r.blocks,
                          capacity_bytes=r.capacity_bytes, hits=r.hits, misses=r.misses,
                          evictions=r.evictions, data_port=r.data_port)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- errors --------------------------------------------------------------------

    def _call(self, op: str, deadline: float, fn):
        """fn(timeout) under what is left of the call's deadline; gRPC errors become
        KVStoreUnavailable."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KVStoreUnavailable(
                f"KV store at {self.target}: {op} ran out of its {self.timeout_s:g}s deadline",
                code=grpc.StatusCode.DEADLINE_EXCEEDED.name)
        try:
            return fn(remaining)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            name = code.name if code is not None else None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                details = f"no answer within {self.timeout_s:g}s"
            raise KVStoreUnavailable(f"KV store at {self.target}: {op} failed: {name}: {details}",
                                     code=name) from exc
