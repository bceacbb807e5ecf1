"""Copies between a KV staging arena in shared memory and the GPU, one per
block, pageable and then pinned (StagingArena.pin, cudaHostRegister): what
the store connector's loads and saves cost on the device's side.

    python -m tandem.bench.staging_copy --blocks 136     # a 2,175-token Llama-3-8B prompt
"""
from __future__ import annotations

import argparse
import time

import torch

from tandem.engine.connector.base import KVCacheLayout
from tandem.engine.connector.staging import StagingArena
from tandem.services.kvstore.shared_arena import SharedArena


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.staging_copy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=136, help="blocks per copy (default 136)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    # Llama-3-8B in bf16: 32 layers, K and V, 16 tokens, 8 KV heads of 128: 2 MiB a block.
    layout = KVCacheLayout(num_layers=32, num_blocks=args.blocks, block_size=16, num_kv_heads=8, head_dim=128,
                           dtype=torch.bfloat16, device=torch.device("cuda"), model_key="bench")
    segment = SharedArena(args.blocks * StagingArena.slot_size(layout))
    arena = StagingArena(segment.view, layout)
    on_device = torch.empty((args.blocks, *arena.block_shape), dtype=layout.dtype, device="cuda")

    def to_device() -> None:
        for i in range(args.blocks):
            on_device[i].copy_(arena.blocks[i], non_blocking=True)
        torch.cuda.synchronize()

    def to_host() -> None:
        for i in range(args.blocks):
            arena.blocks[i].copy_(on_device[i], non_blocking=True)
        torch.cuda.synchronize()

    try:
        for label in ("pageable", "pinned"):
            if label == "pinned" and not arena.pin():
                print("pinned: cudaHostRegister refused the arena")
                break
            for name, copy in (("host to device", to_device), ("device to host", to_host)):
                copy()  # once unmeasured
                start = time.perf_counter()
                copy()
                seconds = time.perf_counter() - start
                print(f"{label:<9} {name}: {args.blocks * arena.data_bytes / seconds / 1e9:5.1f} GB/s "
                      f"({seconds * 1e3:.1f} ms for {args.blocks} blocks)")
    finally:
        segment.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
