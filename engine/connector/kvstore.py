"""KV connector to tandem's KV store service (gRPC).

Store keys are "<chained block hash hex>/<layer>", so a block saved by any
prefill instance is a prefix-cache hit for every decode (and prefill)
instance. A block counts as present when its last layer is: layers are saved
in order, so the last one arriving means the whole block did.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tandem.engine.connector.base import BlockTransfer, ConnectorMeta, ConnectorStats, KVConnector
from tandem.engine.connector.serialization import decode_block, encode_block

log = logging.getLogger(__name__)


def block_key(block_hash: bytes, layer: int) -> str:
    return f"{block_hash.hex()}/{layer}"


class KVStoreConnector(KVConnector):
    def __init__(self, config, kv, runner, timeout_s: float = 5.0) -> None:
        from tandem.services.kvstore.client import KVStoreClient

        if not config.kv_connector_url:
            raise ValueError("the kvstore connector needs kv_connector_url (host:port of the KV store)")
        self.client = KVStoreClient(config.kv_connector_url, timeout_s=timeout_s,
                                    tls=config.kv_connector_tls)
        self.role = config.kv_role
        self.kv = kv
        self.block_size = kv.block_size
        self.num_layers = runner.num_layers
        self.dtype = runner.dtype
        self.block_shape = (2, self.block_size, runner.num_kv_heads, runner.head_dim)
        self.stats = ConnectorStats()
        self._pending_loads: dict[str, BlockTransfer] = {}
        # One thread: layers are put in order, which the presence rule relies on.
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-save")
        self._saves: list[Future] = []
        self._save_started = 0.0

    @property
    def loads(self) -> bool:
        return self.role in ("consumer", "both")

    @property
    def saves(self) -> bool:
        return self.role in ("producer", "both")

    # ---- scheduler side ------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_local_hit_tokens: int) -> int:
        if not self.loads:
            return 0
        hashes = self.kv.block_hashes(request)
        first = num_local_hit_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # leave one token to compute
        candidates = hashes[first:last]
        if not candidates:
            return 0
        try:
            present = self.client.exists([block_key(h, self.num_layers - 1) for h in candidates])
        except Exception as exc:  # store down: compute locally instead
            self.stats.lookup_failures += 1
            log.warning("KV store lookup failed, computing locally: %s", exc)
            return 0
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n * self.block_size

    def update_state_after_alloc(self, request, block_ids, num_local_hit_tokens, num_external_tokens) -> None:
        if num_external_tokens <= 0:
            return
        first = num_local_hit_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        hashes = self.kv.block_hashes(request)
        self._pending_loads[request.request_id] = BlockTransfer(
            request.request_id, block_ids[first:last], hashes[first:last])

    def build_meta(self, plan) -> ConnectorMeta:
        meta = ConnectorMeta()
        for s in plan.scheduled:
            rid = s.request.request_id
            load = self._pending_loads.pop(rid, None)
            if load is not None:
                meta.loads.append(load)
            if self.saves:
                # prompt blocks that become complete in this step
                end = min(s.start + s.num_new_tokens, s.request.num_prompt_tokens)
                first, last = s.start // self.block_size, end // self.block_size
                if last > first:
                    hashes = self.kv.block_hashes(s.request)
                    meta.saves.append(BlockTransfer(rid, s.block_ids[first:last], hashes[first:last]))
        return meta

    def request_finished(self, request) -> None:
        self._pending_loads.pop(request.request_id, None)

    # ---- worker side ---------------------------------------------------
    def start_load(self, meta: ConnectorMeta, kv_caches: list[torch.Tensor]) -> set[str]:
        failed: set[str] = set()
        for t in meta.loads:
            started = time.monotonic()
            keys = [block_key(h, layer) for layer in range(self.num_layers) for h in t.block_hashes]
            try:
                payloads = self.client.get(keys)
                if any(p is None for p in payloads):
                    raise KeyError("evicted from the store between lookup and load")
                num_bytes = 0
                for i, payload in enumerate(payloads):
                    layer, j = divmod(i, len(t.block_hashes))
                    block = decode_block(payload, self.dtype, self.block_shape, layer)
                    kv_caches[layer][:, t.block_ids[j]].copy_(block)
                    num_bytes += len(payload)
            except Exception as exc:  # store down, evicted, or a foreign block format
                failed.add(t.request_id)
                self.stats.load_failures += 1
                log.warning("KV load for %s failed, recomputing its prefix: %s", t.request_id, exc)
                continue
            self.stats.load_blocks += len(t.block_ids)
            self.stats.load_bytes += num_bytes
            self.stats.load_seconds += time.monotonic() - started
        return failed

    def save_layer(self, layer: int, kv_caches: list[torch.Tensor], meta: ConnectorMeta) -> None:
        if layer == 0:
            self._save_started = time.monotonic()
        items = []
        for t in meta.saves:
            # Copy now: the encoding runs on the saver thread while later layers compute.
            blocks = kv_caches[layer][:, t.block_ids].transpose(0, 1).to("cpu", copy=True)
            items.extend((block_key(h, layer), blocks[j]) for j, h in enumerate(t.block_hashes))
        if items:
            self._saves.append(self._saver.submit(self._put, items, layer))

    def _put(self, items: list[tuple[str, torch.Tensor]], layer: int) -> tuple[int, int]:
        """Store one layer's blocks; returns (bytes, blocks completed by this layer)."""
        encoded = [(key, encode_block(block, layer)) for key, block in items]
        self.client.put(encoded)
        completed = len(items) if layer == self.num_layers - 1 else 0
        return sum(len(v) for _, v in encoded), completed

    def wait_for_save(self) -> None:
        futures, self._saves = self._saves, []
        for fut in futures:
            try:
                num_bytes, completed = fut.result()
                self.stats.save_bytes += num_bytes
                self.stats.save_blocks += completed
            except Exception as exc:  # the decode side will recompute; never fail the request
                self.stats.save_failures += 1
                log.warning("KV save failed: %s", exc)
        if futures:
            self.stats.save_seconds += time.monotonic() - self._save_started

    def close(self) -> None:
        self._saver.shutdown(wait=True)
        self.client.close()
