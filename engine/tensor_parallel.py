"""Tensor parallelism: one engine process per rank, torch.distributed
between them for tensors: NCCL on GPUs (rank r on the r-th visible GPU),
gloo on CPUs. The step plan, plain Python data, goes through pipes instead
(engine/tp_channel.py).

Rank 0 is the engine: it schedules, samples and talks to the world. The
other ranks are worker processes (engine/tp_workers.py) that hold their
shard of every layer and of the KV cache and run each step's plan, which
rank 0 sends as plain data (one message a step, engine/tp_channel.py).
Inside the model (models/llama.py) attention heads, KV heads, MLP channels and the
vocabulary are split across ranks: q/k/v and gate/up are column-parallel,
o and down row-parallel with one all-reduce after each, the embedding and
the LM head vocabulary-parallel.

The group is one setting per process, like the kernel backend
(kernels/ops.py): model code reads it when it is built and when it runs.
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1


_group = TPGroup()


def tp_group() -> TPGroup:
    return _group


def rank_device(device_type: str, rank: int) -> torch.device:
    """Where rank `rank` runs: its own visible GPU on CUDA (rank r on cuda:r),
    the CPU otherwise."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device(device_type)


def init_tp(rank: int, world_size: int, init_method: str, device_type: str = "cpu") -> None:
    """Join the tensor-parallel group (blocks until every rank has joined).
    On CUDA this process's current GPU becomes its rank's."""
    global _group
    if world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("this process is in a tensor-parallel group already (one engine with "
                               "--tensor-parallel-size above 1 per process): shut the other down first")
        cuda = device_type == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        # No deadline on collectives: one rank may reach a step's first
        # collective long after another (Triton compiling a kernel, a CUDA
        # graph capture). A gloo rank that dies closes its sockets, which
        # fails the others' collectives at once; tp_workers.py also checks
        # the workers before each step.
        timeout = datetime.timedelta(days=365)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
        if cuda:
            # NCCL builds its communicator at the first collective: here, not
            # inside the first CUDA graph capture, where it cannot.
            dist.all_reduce(torch.zeros(1, device=rank_device("cuda", rank)))
            torch.cuda.synchronize()
    _group = TPGroup(rank, world_size)


def destroy_tp() -> None:
    global _group
    if _group.world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _group = TPGroup()


@contextlib.contextmanager
def unsplit() -> Iterator[None]:
    """Model code built or run inside sees no group: whole layers, no
    collectives. For a model only rank 0 runs (a speculative draft model)."""
    global _group
    saved, _group = _group, TPGroup()
    try:
        yield
    finally:
        _group = saved


def shard_size(total: int, what: str) -> int:
    """This rank's share of `total` (heads, KV heads, channels), which the
    world size must divide."""
    world = _group.world_size
    if total % world:
        raise ValueError(f"--tensor-parallel-size {world} does not divide the model's {total} {what}")
    return total // world


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(first token id, ids per rank) of this rank's vocabulary slice; the
    last slices are padded past the vocabulary when the world does not
    divide it."""
    per_rank = -(-vocab_size // _group.world_size)
    return _group.rank * per_rank, per_rank


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """x summed over the ranks (in place); x itself without a group."""
    if _group.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' x side by side along the last dimension, in rank order."""
    if _group.world_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_group.world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def gather_to_first(x: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """Every rank's x on rank 0, in rank order (None on the other ranks)."""
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_group.world_size)] if _group.rank == 0 else None
    dist.gather(x, gather_list=parts, dst=0)
    return parts


def scatter_from_first(out: torch.Tensor, parts: Optional[list[torch.Tensor]] = None) -> None:
    """Rank 0's parts[r] into rank r's `out` (parts: rank 0's, one per rank, each
    shaped as out; None on the other ranks)."""
    import torch.distributed as dist

    dist.scatter(out, scatter_list=[p.contiguous() for p in parts] if parts is not None else None, src=0)


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x into every rank's x (same shape and dtype on all), queued
    on the device's stream with NCCL: no rank waits on its host for it."""
    if _group.world_size > 1:
        import torch.distributed as dist

        dist.broadcast(x, src=0)
    return x
