"""KV transfer under tensor parallelism.

Each rank caches a slice of the KV heads (rank r: heads [r*h, (r+1)*h)),
yet a stored block holds every head, under the same chained-hash name
whatever the tensor parallelism: a block saved by an engine of one
tensor-parallel size is loaded by an engine of any other. Rank 0 runs the
connector over a view of whole blocks (TPKVCacheView):

- a load writes rank 0's heads into its cache and keeps the other ranks'
  slices, which go out after the step's plan (one scatter a step);
- a save gathers every rank's heads of the saved blocks on rank 0 as each
  layer writes them (one gather a layer), and the connector stages them.

The workers follow the plan's TPKVJob (plain block ids) with the matching
collectives. Why whole blocks through rank 0 rather than one value per head
group from every rank: the store keeps one value per block (fewest keys and
lookups, issue 17's unit), a lookup stays one key per block, and only rank
0 needs a store client, staging arena and mover. The cost is that rank 0
moves every byte of the group's KV to and from the store; where each GPU
has a link of its own, per-rank transfers would scale past that.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from tandem.engine.connector.base import KVCacheView
from tandem.engine.tensor_parallel import gather_to_first, scatter_from_first, tp_group
from tandem.kernels.kv_cache_dtype import movable


@dataclass
class TPKVJob:
    """A step's KV transfer as a tensor-parallel worker takes part in it: the
    plan's connector meta stays on rank 0, the workers get block ids."""

    # Blocks rank 0 loaded this step, in the order of the scatter's blocks.
    load_block_ids: list[int] = field(default_factory=list)
    # Blocks whose layers are gathered for saving, in the connector's save order.
    save_block_ids: list[int] = field(default_factory=list)


class TPKVCacheView(KVCacheView):
    """Rank 0's view of whole blocks: its own heads in its cache, the other
    ranks' over the group."""

    splits_heads = True

    def __init__(self, kv_cache: torch.Tensor) -> None:
        super().__init__(kv_cache)
        self.world_size = tp_group().world_size
        self.heads = kv_cache.shape[4]  # per rank
        self._loaded_ids: list[torch.Tensor] = []
        self._loaded_others: list[torch.Tensor] = []  # per load: heads h.. of its blocks
        self._gathered: Optional[tuple[int, torch.Tensor]] = None

    # ---- loads ---------------------------------------------------------------
    def write_blocks(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        h = self.heads
        movable(self.kv_cache)[:, :, block_ids] = movable(blocks[..., :h, :])
        # The other ranks' heads leave with the plan, after the caller has
        # reused `blocks` (staging slots): copied now, onto the cache's device
        # (NCCL scatters device memory only).
        self._loaded_ids.append(block_ids)
        self._loaded_others.append(blocks[..., h:, :].to(self.kv_cache.device, copy=True))

    def take_loads(self) -> tuple[list[int], Optional[torch.Tensor]]:
        """The blocks written since the last take, and the other ranks' heads of
        them: [layers, 2, n, block_size, (world - 1) * h, head_dim]."""
        if not self._loaded_ids:
            return [], None
        ids = torch.cat(self._loaded_ids).tolist()
        others = torch.cat(self._loaded_others, dim=2)
        self._loaded_ids, self._loaded_others = [], []
        return ids, others

    def send_loads(self, others: torch.Tensor) -> None:
        """Rank r's heads of the loaded blocks to rank r (the workers run
        receive_loads with the same block ids)."""
        h = self.heads
        parts = [torch.empty_like(others[..., :h, :])]  # rank 0's own: written already
        parts += [others[..., (r - 1) * h:r * h, :] for r in range(1, self.world_size)]
        scatter_from_first(torch.empty_like(parts[0]), parts)

    # ---- saves ---------------------------------------------------------------
    def gather_layer(self, layer: int, block_ids: torch.Tensor) -> None:
        """Every rank's heads of layer `layer` of these blocks (the workers run
        send_layer); the next layer_blocks(layer) returns them."""
        parts = gather_to_first(self.kv_cache[layer][:, block_ids])
        self._gathered = (layer, torch.cat(parts, dim=3))

    def layer_blocks(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        gathered, self._gathered = self._gathered, None
        if gathered is None or gathered[0] != layer or gathered[1].shape[1] != len(block_ids):
            raise RuntimeError(f"layer {layer} of {len(block_ids)} blocks was not gathered from the "
                               "tensor-parallel ranks before its save")
        return gathered[1]


# ---- the workers' side ---------------------------------------------------------
def receive_loads(kv_cache: torch.Tensor, block_ids: list[int]) -> None:
    """This rank's heads of the blocks rank 0 loaded, into its cache."""
    layers, _, _, block_size, heads, head_dim = kv_cache.shape
    received = torch.empty((layers, 2, len(block_ids), block_size, heads, head_dim), dtype=kv_cache.dtype,
                           device=kv_cache.device)
    scatter_from_first(received)
    movable(kv_cache)[:, :, torch.tensor(block_ids, device=kv_cache.device)] = movable(received)


def send_layer(kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor) -> None:
    """This rank's heads of layer `layer` of the saved blocks, to rank 0."""
    gather_to_first(kv_cache[layer][:, block_ids])
