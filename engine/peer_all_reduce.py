"""All-reduce of small tensors through GPUs' peer memory, for tensor
parallelism's two all-reduces a layer.

A decode step of an 8B model at TP=2 all-reduces 65 tensors of a few KiB to
a few hundred KiB; through NCCL each costs tens of microseconds of latency,
which the halved weight reads do not pay for. PyTorch's symmetric memory maps
one buffer of every rank into every other rank's address space (CUDA IPC over
NVLink or PCIe) and its one-shot all-reduce reads the peers' copies straight
after a barrier: one kernel, no proxy thread. Larger tensors (prefill chunks)
stay on NCCL, whose ring moves big ones better.

Asked for with --peer-all-reduce, and only where PyTorch has it (CUDA
builds with symmetric memory); NVLink multicast is never asked for: the
one-shot kernel reads peers with plain loads. Otherwise NCCL (gloo on CPUs)
does every all-reduce.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

log = logging.getLogger(__name__)

# Tensors up to this size take the peer path. At TP=2 on H200s inside CUDA
# graphs the one-shot all-reduce took 7.3-7.9 us to NCCL's 7.9-8.4 up to 32 KiB,
# drew level at 128 KiB and lost from 512 KiB (bench/all_reduce.py,
# docs/benchmarks.md).
DEFAULT_MAX_BYTES = 128 << 10
DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class PeerAllReduce:
    buffer: torch.Tensor  # bytes, in symmetric memory: each rank's copy mapped into every rank
    group_name: str
    max_bytes: int
    copy_in_kernel: bool  # the op copies the local input into the buffer itself

    @classmethod
    def build(cls, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> Optional["PeerAllReduce"]:
        """Every rank's buffer mapped into every rank (a collective: all
        ranks call it at once), or None where this PyTorch or machine has no
        symmetric memory, with the reason logged."""
        try:
            import torch.distributed as dist
            import torch.distributed._symmetric_memory as symm

            ops = torch.ops.symm_mem
            _ = ops.one_shot_all_reduce_out  # absent on builds without the op: AttributeError
            if hasattr(symm, "set_backend"):
                try:
                    symm.set_backend("CUDA")  # CUDA IPC, not NVSHMEM (which this image may lack)
                except RuntimeError:
                    pass  # chosen already in this process
            group_name = dist.group.WORLD.group_name
            if hasattr(symm, "enable_symm_mem_for_group"):  # older PyTorch needs it; 2.11 deprecates it
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm.enable_symm_mem_for_group(group_name)
            buffer = symm.empty(max_bytes, dtype=torch.uint8, device=device)
            handle = symm.rendezvous(buffer, group_name)
            handle.barrier()
        except (ImportError, AttributeError, RuntimeError) as exc:
            log.warning("peer all-reduce unavailable (%s); NCCL does every all-reduce", exc)
            return None
        copy_in_kernel = hasattr(ops, "one_shot_all_reduce_copy_out")
        log.info("peer all-reduce on for tensors up to %d bytes", max_bytes)
        return cls(buffer, group_name, max_bytes, copy_in_kernel)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.dtype in DTYPES and x.is_contiguous() and nbytes <= self.max_bytes and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in a new tensor (x is left as it was)."""
        flat = x.view(-1)
        staged = self.buffer[: flat.numel() * flat.element_size()].view(x.dtype)
        out = torch.empty_like(flat)
        if self.copy_in_kernel:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, out)
        else:
            staged.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out.view(x.shape)
