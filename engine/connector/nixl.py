"""KV transfer across hosts with NIXL (PyPI `nixl`, the transfer library vLLM,
Dynamo and llm-d use for prefill/decode): the decode engine reads a finished
prompt's blocks straight out of the prefill engine's KV cache, peer to peer,
over whatever NIXL's UCX backend finds between the two (TCP, shared memory on
one host, RDMA and NVLink where the cluster has them).

The prefill's connector registers its whole KV cache, and one generation
counter per block, with a NIXL agent. When a prompt finishes it asks the
scheduler to hold the prompt's full blocks and hands out a NixlHandle: the
agent's name and metadata (how to reach it, its registered memory), the
cache's address and layout, the blocks' ids and generations. The router
passes the handle to the decode (as for the direct transfer) and releases the
hold once the decode has streamed its first message.

The decode's connector adds the producer's agent once (by name) and, in the
step that admits the request, reads each block's K and V of every layer into
blocks of its own (one NIXL request, two descriptors per block and layer),
then reads the blocks' generation counters: a block whose last hold ended
meanwhile (the pool may have handed it out again) fails the check and the
request computes that part itself. A producer it cannot reach, or a cache of
another layout, is counted once and computed around. Generations grow as in
the direct connector: by one when the last hold on a block ends.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from tandem.engine.connector.base import KVCacheLayout
from tandem.engine.connector.pull import PullConnector, PullMeta

log = logging.getLogger(__name__)

HANDLE_KEY = "nixl"  # the handle's key in Request.kv_transfer_params
TRANSFER_TIMEOUT_S = 30.0


def nixl_api() -> Any:
    """NIXL's Python API from whichever of its wheels is installed (the `nixl`
    meta package, or one CUDA variant alone)."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise ImportError("kv_transfer 'nixl' needs NIXL: pip install 'tandem[nixl]' (or nixl-cu12 / nixl-cu13)")


@dataclass(frozen=True)
class NixlHandle:
    """A prompt's blocks in a prefill engine's KV cache, readable through NIXL."""

    agent: str  # the producer's NIXL agent
    metadata: bytes  # its NIXL metadata: how to reach it and its registered memory
    model: str  # the producer's block-hash salt (model id, dtype): another model's KV never loads
    shape: tuple[int, ...]  # its cache: [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    dtype: str
    mem_type: str  # "DRAM" or "VRAM"
    device: int
    cache_address: int
    generations_address: int  # int64 per block
    block_ids: list[int]  # the prompt's full blocks, in order
    generations: list[int]  # generations[i] of block_ids[i] when the prefill finished


class NixlConnector(PullConnector):
    handle_key = HANDLE_KEY

    def __init__(self, role: str, layout: KVCacheLayout) -> None:
        super().__init__(role, layout)
        api = nixl_api()
        self.agent_name = f"tandem-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(backends=["UCX"]))
        # Producer: one counter per block (where readers can reach it through NIXL).
        self._generations = torch.zeros(layout.num_blocks, dtype=torch.int64)
        # Consumer: the generations read back after a copy (one slot per block of this cache).
        self._read_back = torch.zeros(layout.num_blocks, dtype=torch.int64)
        self._remotes: dict[str, bool] = {}  # producer agent -> reachable
        self._metadata = b""
        self._regs: list = []

    # ---- both: registration ------------------------------------------------
    def register_kv_cache(self, kv_cache: torch.Tensor, view=None) -> None:
        super().register_kv_cache(kv_cache, view)
        self._regs = [self.agent.register_memory(kv_cache), self.agent.register_memory(self._generations),
                      self.agent.register_memory(self._read_back)]
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device = kv_cache.get_device() if kv_cache.is_cuda else 0
        # After registering: the metadata carries the registered memory.
        self._metadata = self.agent.get_agent_metadata()

    # ---- producer: handles and generations ---------------------------------
    def _handle(self, block_ids: list[int]) -> NixlHandle:
        layout = self.layout
        return NixlHandle(
            agent=self.agent_name, metadata=self._metadata, model=layout.model_key, shape=layout.shape,
            dtype=layout.dtype_name, mem_type=self._mem_type, device=self._device,
            cache_address=self.kv_cache.data_ptr(), generations_address=self._generations.data_ptr(),
            block_ids=block_ids, generations=self._generations[block_ids].tolist())

    def _bump_generations(self, block_ids: np.ndarray) -> None:
        self._generations[torch.from_numpy(block_ids)] += 1

    # ---- consumer: reads -----------------------------------------------------
    def _reachable(self, handle: NixlHandle) -> Optional[NixlHandle]:
        if handle.agent not in self._remotes:
            try:
                self.layout.check_peer(handle.model, handle.shape, handle.dtype)
                self.agent.add_remote_agent(handle.metadata)
                self._remotes[handle.agent] = True
            except Exception as exc:
                log.warning("cannot read the prefill's KV cache through NIXL (agent %s), computing prompts "
                            "from it here: %s", handle.agent, exc)
                self._remotes[handle.agent] = False
        return handle if self._remotes[handle.agent] else None

    def _block_descs(self, base: int, num_blocks: int, ids: list[int], device: int) -> np.ndarray:
        """(address, length, device) of each block's K and V in every layer: [len(ids) * layers * 2, 3]."""
        layers = self.layout.num_layers
        region = self.layout.block_bytes // (2 * layers)  # one block of one layer's K (or V)
        # Cache [layers, 2, blocks, ...]: region (layer, kv, block) starts at ((layer * 2 + kv) * blocks + block) * region.
        planes = np.arange(2 * layers, dtype=np.uint64)[:, None] * np.uint64(num_blocks)
        index = planes + np.asarray(ids, dtype=np.uint64)[None, :]
        out = np.empty((index.size, 3), dtype=np.uint64)
        out[:, 0] = np.uint64(base) + index.reshape(-1) * np.uint64(region)
        out[:, 1] = region
        out[:, 2] = device
        return out

    def _read(self, handle: NixlHandle, local: np.ndarray, local_mem: str, remote: np.ndarray,
              remote_mem: str) -> None:
        """One NIXL READ of the remote regions into the local ones; raises on failure."""
        xfer = self.agent.initialize_xfer(
            "READ", self.agent.get_xfer_descs(local, mem_type=local_mem),
            self.agent.get_xfer_descs(remote, mem_type=remote_mem), handle.agent)
        try:
            state = self.agent.transfer(xfer)
            deadline = time.monotonic() + TRANSFER_TIMEOUT_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer from {handle.agent} within {TRANSFER_TIMEOUT_S:g} s")
                state = self.agent.check_xfer_state(xfer)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer from {handle.agent} ended in state {state}")
        finally:
            self.agent.release_xfer_handle(xfer)

    def start_load(self, meta: PullMeta) -> set[str]:
        if not meta.loads:
            return set()
        started = time.monotonic()
        if self.kv_cache.is_cuda:
            # NIXL's reads are not ordered by the CUDA stream: this step's
            # host-tier swap-outs, queued on it, must have read blocks a load
            # now overwrites.
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
        failed: set[str] = set()
        own = self.layout
        for load in meta.loads:
            h = load.handle
            try:
                self._read(h, self._block_descs(self.kv_cache.data_ptr(), own.num_blocks, load.dst, self._device),
                           self._mem_type, self._block_descs(h.cache_address, h.shape[2], load.src, h.device),
                           h.mem_type)
                # The generations after the copy, into this engine's scratch row (one slot per block).
                scratch = np.arange(len(load.src), dtype=np.uint64)
                local = np.stack([np.uint64(self._read_back.data_ptr()) + scratch * np.uint64(8),
                                  np.full_like(scratch, 8), np.zeros_like(scratch)], axis=1)
                remote = np.stack([np.uint64(h.generations_address) + np.asarray(load.src, dtype=np.uint64)
                                   * np.uint64(8), np.full_like(scratch, 8), np.zeros_like(scratch)], axis=1)
                self._read(h, local, "DRAM", remote, "DRAM")  # the counters live in host memory
            except Exception as exc:
                log.warning("NIXL read of %s's KV failed, computing it here: %s", load.request_id, exc)
                self.stats.load_failures += 1
                failed.add(load.request_id)
                continue
            if self._read_back[:len(load.src)].tolist() != load.expected:
                log.warning("KV blocks of %s were released by the prefill before the read: recomputing",
                            load.request_id)
                self.stats.load_failures += 1
                failed.add(load.request_id)
                continue
            self.stats.load_blocks += len(load.src)
            self.stats.load_bytes += len(load.src) * own.block_bytes
        self.stats.load_seconds += time.monotonic() - started
        return failed

    def close(self) -> None:
        for reg in getattr(self, "_regs", []):
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass
        self._regs = []
