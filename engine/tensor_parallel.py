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
import logging
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from tandem.engine.peer_all_reduce import PeerAllReduce
from tandem.kernels.kv_cache_dtype import movable  # gloo has no FP8: an FP8 cache's KV goes as bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1


_group = TPGroup()
_peer: Optional[PeerAllReduce] = None  # small all-reduces through peer memory (CUDA)


def tp_group() -> TPGroup:
    return _group


def rank_device(device_type: str, rank: int) -> torch.device:
    """Where rank `rank` runs: its own visible GPU on CUDA (rank r on cuda:r),
    the CPU otherwise."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device(device_type)


def init_tp(rank: int, world_size: int, init_method: str, device_type: str = "cpu",
            peer_all_reduce: bool = False) -> None:
    """Join the tensor-parallel group (blocks until every rank has joined).
    On CUDA this process's current GPU becomes its rank's, and with
    peer_all_reduce small all-reduces go through peer memory
    (engine/peer_all_reduce.py; --peer-all-reduce)."""
    global _group, _peer
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
            if peer_all_reduce:
                _peer = _agreed(PeerAllReduce.build(rank_device("cuda", rank)), rank)
    _group = TPGroup(rank, world_size)


def _agreed(peer: Optional[PeerAllReduce], rank: int) -> Optional[PeerAllReduce]:
    """The peer path only if every rank has it: a tensor one rank sums by
    peer memory and another by NCCL would leave both waiting."""
    import torch.distributed as dist

    everyone = torch.tensor([peer is not None], dtype=torch.int32, device=rank_device("cuda", rank))
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    return peer if bool(everyone.item()) else None


def abort_tp() -> None:
    """Cut short the collectives this rank waits in, after a rank was lost:
    NCCL's never end otherwise (gloo's fail by themselves when a peer's
    sockets close). The group is unusable after."""
    import torch.distributed as dist

    if _group.world_size > 1 and dist.is_initialized() and dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()


def _destroy_group() -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError) as exc:  # e.g. aborted after a lost rank
        log.warning("tensor-parallel group teardown: %s", exc)


def destroy_tp(timeout_s: float = 30.0) -> None:
    """Leave the group. Bounded: NCCL's teardown has known ways to wait for
    ever (a live captured graph, a peer gone mid-collective); shutting down
    must not, so after timeout_s it is left to the process's exit."""
    global _group, _peer
    if _peer is not None:  # its buffer is mapped into the other ranks: unmapped before the group goes
        torch.cuda.synchronize()
        _peer = None
    if _group.world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            done = threading.Thread(target=_destroy_group, name="tp-destroy", daemon=True)
            done.start()
            done.join(timeout_s)
            if done.is_alive():
                log.error("tensor-parallel group teardown took over %.0f s; left to the process's exit",
                          timeout_s)
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
    """x summed over the ranks: x itself (summed in place), or a new tensor
    where peer memory sums it; x unchanged without a group."""
    if _group.world_size > 1:
        if _peer is not None and _peer.fits(x):
            return _peer(x)
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
    dist.gather(movable(x), gather_list=[movable(p) for p in parts] if parts is not None else None, dst=0)
    return parts


def scatter_from_first(out: torch.Tensor, parts: Optional[list[torch.Tensor]] = None) -> None:
    """Rank 0's parts[r] into rank r's `out` (parts: rank 0's, one per rank, each
    shaped as out; None on the other ranks)."""
    import torch.distributed as dist

    dist.scatter(movable(out), scatter_list=[movable(p.contiguous()) for p in parts] if parts is not None else None,
                 src=0)


def gather_objects_to_first(obj: object) -> Optional[list]:
    """Every rank's obj (picklable) on rank 0, in rank order; None elsewhere.
    For set-up, not steps: it pickles and goes through the host."""
    import torch.distributed as dist

    parts = [None] * _group.world_size if _group.rank == 0 else None
    dist.gather_object(obj, parts, dst=0)
    return parts


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x into every rank's x (same shape and dtype on all), queued
    on the device's stream with NCCL: no rank waits on its host for it."""
    if _group.world_size > 1:
        import torch.distributed as dist

        dist.broadcast(x, src=0)
    return x
