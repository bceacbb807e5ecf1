"""The compute roofline of an offline run: the workload's arithmetic
(2 FLOPs per parameter per token, prompt and output tokens alike: each passes
through every weight once) against the matrix-multiply peak of this device
in the engine's precision, measured in the same run.

fraction = (FLOPs / peak) / measured seconds: 1.0 would be a run that did
nothing but full-speed matrix products. Attention's own arithmetic is left
out, as in the issue's figure (2 x 8.03 B parameters x tokens), so the
fraction reads the same across context lengths.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Roofline:
    peak_flops: float  # FLOP/s of a large matmul, measured
    workload_flops: float
    seconds: float  # the run's measured time
    precision: str
    # The same matmul back to back, at the clock the GPU's power limit holds
    # it to (NaN off CUDA): what a long run can reach, where peak_flops is
    # what a burst reaches.
    sustained_flops: float = float("nan")

    @property
    def fraction(self) -> float:
        return self.workload_flops / self.peak_flops / self.seconds

    @property
    def sustained_fraction(self) -> float:
        return self.workload_flops / self.sustained_flops / self.seconds


def model_parameters(model: torch.nn.Module) -> float:
    """Parameters a token multiplies by: every tensor once (a tied LM head
    counts once), FP8 scales left out; a mixture-of-experts layer's experts
    count top_k / num_experts of theirs, the k experts a token passes
    through (Qwen3-30B-A3B: 3.3 B of 30.5 B)."""
    from tandem.engine.models.moe import SparseMoeBlock

    share: dict[int, float] = {}  # id(parameter) -> the part of it one token multiplies by
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            for p in module.experts.parameters():
                share[id(p)] = module.moe.top_k / module.moe.num_experts
    seen, total = set(), 0.0
    for name, p in model.named_parameters():
        if id(p) in seen or name.endswith("_scale"):
            continue
        seen.add(id(p))
        total += p.numel() * share.get(id(p), 1.0)
    return total


def _square_product(device: torch.device, dtype: torch.dtype, fp8: bool) -> tuple[Callable[[], torch.Tensor], float]:
    """(a square matmul large enough to fill the device, its FLOPs): in
    bf16/fp16/fp32 as the engine's dtype, or e4m3 through torch._scaled_mm
    for FP8 engines."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    if fp8:
        from tandem.kernels.fp8_torch import FP8_DTYPE

        a8, b8 = a.to(FP8_DTYPE), b.to(FP8_DTYPE).t().contiguous().t()
        ones_a = torch.ones(n, 1, device=device)
        ones_b = torch.ones(1, n, device=device)

        def product():
            return torch._scaled_mm(a8, b8, scale_a=ones_a, scale_b=ones_b, out_dtype=torch.bfloat16)
    else:
        def product():
            return a @ b
    return product, 2.0 * n ** 3


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, fp8: bool = False) -> float:
    """FLOP/s of a large square matmul (_square_product), the best of ten
    timed one at a time after three warm-ups (CUDA events on a GPU): the
    rate at the GPU's full clock, which the pauses between them let it keep."""
    product, flops = _square_product(device, dtype, fp8)
    times = []
    for i in range(13):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            product()
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            product()
            seconds = time.perf_counter() - t0
        if i >= 3:
            times.append(seconds)
    return flops / min(times) if times else float("nan")


def sustained_matmul_flops(device: torch.device, dtype: torch.dtype, fp8: bool = False,
                           seconds: float = 3.0) -> float:
    """FLOP/s of the same matmul run back to back for `seconds` (CUDA), over
    the last third: the rate once the GPU has lowered its clock to hold its
    power limit, as it does through a long run. NaN on other devices (no
    power limit to reach)."""
    if device.type != "cuda":
        return float("nan")
    product, flops = _square_product(device, dtype, fp8)
    product()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls = 0
    while time.perf_counter() - t0 < seconds * 2 / 3:  # one call's queueing is far shorter than its run
        product()
        calls += 1
        if calls % 16 == 0:
            torch.cuda.synchronize()  # keep the queue short, so the clock above is the GPU's
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timed = max(4, calls // 2)
    start.record()
    for _ in range(timed):
        product()
    end.record()
    torch.cuda.synchronize()
    return flops * timed / (start.elapsed_time(end) / 1e3)


def copy_bandwidth(device) -> float:
    """Bytes per second of a large device-to-device copy, counting read + write."""
    if device.type != "cuda":
        src = torch.empty(64 * 2**20, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        start = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        return 2 * src.numel() * 10 / (time.perf_counter() - start)
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start_ev.record()
        dst.copy_(src)
        end_ev.record()
        torch.cuda.synchronize()
        times.append(start_ev.elapsed_time(end_ev) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2 * 2**30 / statistics.median(times)


def unread_embedding(model) -> tuple[int, int]:
    """(bytes, parameters) of the input embedding's table when it is not the
    LM head's too: a step reads only its tokens' rows of it, not the table."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if embed is None or (head is not None and head.weight is embed.weight):
        return 0, 0
    return embed.weight.numel() * embed.weight.element_size(), embed.weight.numel()


@dataclass
class LeastTime:
    """The least time an offline run could take on this device: the linear
    layers' arithmetic at the matmul rate the GPU sustains, plus the KV its
    decode steps read at the copy bandwidth. Attention's arithmetic, weight
    reads at small batch, launches and the host are left out, so a run can
    only take longer. Unlike Roofline's workload FLOPs (the issue's 2 x
    parameters x tokens), an untied input embedding is a gather and the LM
    head multiplies only the rows sampled, so this is the arithmetic the run
    cannot avoid."""
    gemm_flops: float
    sustained_flops: float
    kv_read_bytes: float
    copy_bandwidth: float  # bytes/s, read + write

    @property
    def arithmetic_seconds(self) -> float:
        return self.gemm_flops / self.sustained_flops

    @property
    def kv_read_seconds(self) -> float:
        return self.kv_read_bytes / self.copy_bandwidth

    @property
    def seconds(self) -> float:
        return self.arithmetic_seconds + self.kv_read_seconds


def gemm_flops(model: torch.nn.Module, tokens: int, sampled_tokens: int) -> float:
    """FLOPs of the linear layers over a run: every token through the
    decoder's weights (model_parameters' count, experts by their share),
    only the sampled rows through the LM head, no untied input embedding."""
    head = getattr(model, "lm_head", None)
    head_params = head.weight.numel() if head is not None else 0
    body = model_parameters(model) - unread_embedding(model)[1] - head_params
    return 2.0 * (body * tokens + head_params * sampled_tokens)


def decode_kv_tokens(prompt_lens: list[int], output_lens: list[int]) -> int:
    """Cached tokens the decode steps of these requests read: the step that
    makes output token i >= 1 attends over the prompt and i tokens more
    (token 0 comes from the prompt's own step)."""
    return sum((n - 1) * p + (n - 1) * n // 2 for p, n in zip(prompt_lens, output_lens) if n > 1)


def measure(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, fp8: bool, tokens: int,
            seconds: float) -> Roofline:
    precision = "fp8" if fp8 else str(dtype).removeprefix("torch.")
    return Roofline(matmul_peak_flops(device, dtype, fp8), 2.0 * model_parameters(model) * tokens, seconds,
                    precision, sustained_matmul_flops(device, dtype, fp8))


__all__ = ["LeastTime", "Roofline", "copy_bandwidth", "decode_kv_tokens", "gemm_flops", "matmul_peak_flops",
           "measure", "model_parameters", "sustained_matmul_flops", "unread_embedding"]
