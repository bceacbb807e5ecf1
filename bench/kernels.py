"""`tandem bench kernels`: the attention kernels against the GPU's own limits.

Decode attention is memory bound: each step reads every KV byte of the batch
once. So its figure of merit is KV bytes read per second as a fraction of the
device-to-device copy bandwidth (bytes read + written) measured in the same
run; the goal is >= 0.7. Prefill attention is compute bound: FLOP/s as a
fraction of a large bf16 matmul's, measured in the same run too.

Timing: decode calls are captured in a CUDA graph (launch gaps would
otherwise dominate small shapes) over several input sets with disjoint random
blocks, more bytes in all than the L2 cache holds, and the median replay time
is divided by the number of calls. Each cell also times a copy of the same
bytes in the same way: at small sizes one launch's latency, not bandwidth,
bounds a copy too, and that tells which cells can reach the goal at all.
The large copy, matmul and prefill use
triton.testing.do_bench's median.

    python -m tandem.bench.kernels --json kernels.json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from tandem.services.common.config import add_flag

DTYPES = ("bf16", "fp16")


@dataclass
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written per second / 1e9
    matmul_tflops: float  # bf16 dense matmul


@dataclass
class DecodeRow:
    batch: int
    context: int
    us: float  # median time per call
    kv_gbps: float  # KV bytes read per second / 1e9
    fraction_of_copy: float
    max_rel_error: float
    partition_size: int
    config: str
    # The same bytes moved by a device-to-device copy (half read, half written)
    # in the same harness: what one launch can reach at this size. Small shapes
    # are bound by launch and memory latency, not bandwidth, for a copy too.
    same_size_copy_gbps: float = 0.0
    fraction_of_same_size_copy: float = 0.0


@dataclass
class PrefillRow:
    query_len: int
    prefix_len: int
    ms: float
    tflops: float
    fraction_of_matmul: float
    max_rel_error: float
    num_prompts: int = 1  # prompts of query_len in the launch
    # torch's cuDNN attention on the same prompts (no prefix: it has no paged
    # cache), a reference for what a library kernel reaches at this size; 0: not run
    cudnn_tflops: float = 0.0
    cudnn_fraction_of_matmul: float = 0.0


@dataclass
class MixedRow:
    """One chunked-prefill step: many decodes plus one prompt chunk over a cached prefix."""
    decodes: int
    decode_context: int
    chunk: int
    prefix: int
    ms: float
    kv_gbps: float  # KV bytes the batch must read (each sequence's context once) per second
    fraction_of_copy: float
    max_rel_error: float


@dataclass
class DecodeVariantRow:
    """One way of reading the cache (--decode-variants) on the sweep shapes."""
    layout: str  # "tokens-outer" (the engine's blocks) or "heads-outer"
    grid_heads_first: bool
    values_after_scores: bool
    shapes: list[tuple[int, int]]  # (batch, context)
    us: list[float]
    fractions: list[float]  # KV bytes read a second over the large copy's, per shape
    max_rel_error: float


# The layouts --decode-variants reads: the engine's block, [block_size,
# kv_heads, head_dim] in memory, and the heads-outer one, [kv_heads,
# block_size, head_dim], where one KV head's rows of a block are contiguous.
LAYOUTS = ("tokens-outer", "heads-outer")


@dataclass
class Report:
    device: str
    torch_version: str
    triton_version: str
    shape: dict
    ceilings: Ceilings
    decode: list[DecodeRow] = field(default_factory=list)
    prefill: list[PrefillRow] = field(default_factory=list)
    mixed: list[MixedRow] = field(default_factory=list)
    sweep: list[dict] = field(default_factory=list)
    decode_variants: list[DecodeVariantRow] = field(default_factory=list)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _shape_list(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        batch, sep, context = item.strip().partition("x")
        if not (sep and batch.isdigit() and context.isdigit()):
            raise argparse.ArgumentTypeError(
                f"expected BATCHxCONTEXT pairs such as 1x8192,8x512; got {item!r}")
        shapes.append((int(batch), int(context)))
    return shapes


SWEEP_SHAPES = ((1, 8192), (8, 2048), (32, 4096), (64, 512), (256, 1024), (256, 8192))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--batches", type=_int_list, default=[1, 8, 32, 64, 128, 256],
             help="decode batch sizes, comma-separated")
    add_flag(parser, "--contexts", type=_int_list, default=[512, 1024, 2048, 4096, 8192],
             help="decode context lengths (tokens per sequence), comma-separated")
    add_flag(parser, "--num-heads", type=int, default=32, help="query heads (Llama-3-8B: 32)")
    add_flag(parser, "--num-kv-heads", type=int, default=8, help="KV heads (Llama-3-8B: 8)")
    add_flag(parser, "--head-dim", type=int, default=128, help="head dimension")
    add_flag(parser, "--block-size", type=int, default=16, help="tokens per KV block")
    add_flag(parser, "--dtype", choices=DTYPES, default="bf16", help="KV cache and query dtype")
    add_flag(parser, "--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
             help="the decode table's KV cache: auto in --dtype, fp8 in e4m3 (the engine's "
                  "--kv-cache-dtype fp8); the bytes a step reads count its 1-byte elements")
    add_flag(parser, "--copy-mib", type=int, default=2048,
             help="size of the buffer copied to measure copy bandwidth, MiB")
    add_flag(parser, "--sweep", type=bool,
             help="also time a grid of decode settings (tile, splits per SM, the splits "
                  "always combined in the one launch or always by a second kernel) on "
                  "--sweep-shapes, and of prefill tiles unless --skip-prefill, to choose the "
                  "configs' defaults")
    add_flag(parser, "--sweep-shapes", type=_shape_list,
             default=",".join(f"{b}x{c}" for b, c in SWEEP_SHAPES),
             help="decode shapes the sweep times, as BATCHxCONTEXT, comma-separated")
    add_flag(parser, "--tile-sweep", type=bool,
             help="also time the decode kernel's tiles (tokens a tile, warps, pipeline stages) "
                  "on --sweep-shapes, the splits as the defaults choose them")
    add_flag(parser, "--decode-variants", type=bool,
             help="also time the decode kernel's grid order (KV heads first) and load order "
                  "(values after the scores), each over the engine's block layout and over a "
                  "heads-outer one ([blocks, kv_heads, block_size, head_dim] in memory), on "
                  "--sweep-shapes, the tiles as the defaults choose them")
    add_flag(parser, "--skip-prefill", type=bool,
             help="leave out the prefill and mixed (decodes + prompt chunk) tables")
    add_flag(parser, "--json", default="kernels.json", help="where to write all numbers")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "kernels", help="attention kernels vs. copy bandwidth and matmul rate (CUDA)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(handler=run)


# ---------------------------------------------------------------- measurement


def measure_ceilings(copy_mib: int) -> Ceilings:
    import torch
    from triton.testing import do_bench

    n = copy_mib * 2**20 // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    copy_gbps = 2 * src.numel() * 2 / (ms * 1e-3) / 1e9
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return Ceilings(copy_gbps=copy_gbps, matmul_tflops=2 * 8192**3 / (ms * 1e-3) / 1e12)


def time_graph_ms(fn, reps: int = 50) -> float:
    """Median milliseconds of one replay of a CUDA graph that runs fn once."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


class DecodeBench:
    """A KV pool large enough for the biggest shape; each input set takes disjoint
    random blocks of it, so rotating sets defeats the L2 cache."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
        props = torch.cuda.get_device_properties(0)
        self.l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
        bs = args.block_size
        shapes = [(b, c) for b in args.batches for c in args.contexts]
        if args.sweep or args.tile_sweep or args.decode_variants:  # the sweeps' shapes draw from the same pool
            shapes += list(args.sweep_shapes)
        self.pool_blocks = max(b * math.ceil(c / bs) for b, c in shapes)
        self.pool_blocks = max(self.pool_blocks, 4 * self.l2_bytes // self.block_bytes + 64)
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.kv_cache = torch.randn(2, self.pool_blocks, bs, args.num_kv_heads, args.head_dim,
                                    device="cuda", dtype=self.dtype, generator=gen)
        if args.kv_cache_dtype == "fp8":
            from tandem.kernels.kv_cache_dtype import FP8_KV_DTYPE

            self.kv_cache = self.kv_cache.to(FP8_KV_DTYPE)

    @property
    def block_bytes(self) -> int:
        a = self.args
        item = 1 if a.kv_cache_dtype == "fp8" else 2
        return 2 * a.block_size * a.num_kv_heads * a.head_dim * item  # K and V

    def input_sets(self, batch: int, context: int):
        import torch

        from tandem.kernels.metadata import AttentionMetadata

        a = self.args
        blocks_per_seq = math.ceil(context / a.block_size)
        set_blocks = batch * blocks_per_seq
        set_bytes = set_blocks * self.block_bytes
        count = max(1, min(32, math.ceil(3 * self.l2_bytes / set_bytes),
                           self.pool_blocks // set_blocks))
        perm = torch.randperm(self.pool_blocks, device="cuda")
        sets = []
        for i in range(count):
            tables = perm[i * set_blocks:(i + 1) * set_blocks].view(batch, blocks_per_seq)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(batch, dtype=torch.long, device="cuda"),
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
                block_tables=tables.to(torch.int32).contiguous(),
                max_query_len=1, max_seq_len=context,
                query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[context] * batch)
            query = torch.randn(batch, a.num_heads, a.head_dim, device="cuda", dtype=self.dtype)
            sets.append((query, meta))
        return sets, set_bytes

    def run(self, batch: int, context: int, config=None, check: bool = True,
            same_size_copy: bool = True) -> DecodeRow:
        from tandem.kernels.attention_triton import (DEFAULT_CONFIG, _num_sms, decode_grid, decode_tiles,
                                                     paged_attention_triton)
        from tandem.kernels.paged_attention_torch import paged_attention_torch
        from tandem.kernels.selfcheck import rel_error

        import torch

        a = self.args
        config = config or DEFAULT_CONFIG
        scale = a.head_dim ** -0.5
        sets, set_bytes = self.input_sets(batch, context)
        err = 0.0
        if check:
            query, meta = sets[0]
            out = paged_attention_triton(query, self.kv_cache, meta, scale, config)
            ref = paged_attention_torch(query, self.kv_cache, meta, scale)
            err = rel_error(out, ref)
        outs = [None] * len(sets)

        def step() -> None:
            for i, (query, meta) in enumerate(sets):
                outs[i] = paged_attention_triton(query, self.kv_cache, meta, scale, config)

        us = time_graph_ms(step) * 1e3 / len(sets)
        del outs
        torch.cuda.empty_cache()
        gbps = set_bytes / (us * 1e-6) / 1e9
        # 0: not measured (the sweep leaves it out)
        copy_gbps = self.same_size_copy_gbps(set_bytes, len(sets)) if same_size_copy else 0.0
        d = decode_tiles(config.decode, self.kv_cache.dtype)  # the tiles the call used
        grid = decode_grid(batch, a.num_kv_heads, context, _num_sms(torch.device("cuda")), d)
        return DecodeRow(batch=batch, context=context, us=us, kv_gbps=gbps,
                         fraction_of_copy=0.0, max_rel_error=err, partition_size=grid.partition_size,
                         same_size_copy_gbps=copy_gbps,
                         fraction_of_same_size_copy=gbps / copy_gbps if copy_gbps else 0.0,
                         config=f"block_n={grid.block_n} programs_per_sm={d.programs_per_sm} "
                                f"warps={grid.num_warps} stages={grid.num_stages} "
                                f"fused_max_splits={d.fused_max_splits}")

    def same_size_copy_gbps(self, num_bytes: int, count: int) -> float:
        """Bytes per second (read + written) of copies that move num_bytes in all,
        timed like the attention calls: count buffers in rotation, one graph.
        The faster of two copies: a same-dtype copy_ (captured as a memcpy node,
        which at large sizes runs slower than a kernel) and an elementwise
        kernel that reads and writes the same bytes."""
        import torch

        half = max(1, num_bytes // 4)  # bf16 elements read; as many written
        srcs = [torch.randn(half, device="cuda", dtype=self.dtype) for _ in range(count)]
        dsts = [torch.empty_like(t) for t in srcs]

        def memcpy() -> None:
            for src, dst in zip(srcs, dsts):
                dst.copy_(src)

        def kernel() -> None:
            for src, dst in zip(srcs, dsts):
                torch.neg(src, out=dst)

        us = min(time_graph_ms(memcpy), time_graph_ms(kernel)) * 1e3 / count
        del srcs, dsts
        torch.cuda.empty_cache()
        return 4 * half / (us * 1e-6) / 1e9


# (new tokens, cached prefix, prompts): one prompt of 2k, 4k and 8k tokens (issue
# 20's mark), chunks over a cached prefix, and prompts of 2k-8k filling the
# engine's 16,384-token step on an 80 GB GPU, as a busy prefill role runs them.
PREFILL_SHAPES = ((2048, 0, 1), (4096, 0, 1), (8192, 0, 1), (2048, 2048, 1), (512, 7680, 1),
                  (2048, 0, 8), (4096, 0, 4), (8192, 0, 2))


def run_prefill(args: argparse.Namespace, ceilings: Ceilings, config=None,
                check: bool = True, reference: bool = True) -> list[PrefillRow]:
    import torch
    from triton.testing import do_bench

    from tandem.kernels.attention_triton import paged_attention_triton
    from tandem.kernels.paged_attention_torch import write_kv_torch
    from tandem.kernels.selfcheck import make_batch, rel_error, twin_attention

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gen = torch.Generator().manual_seed(1)
    group = args.num_heads // args.num_kv_heads
    rows = []
    for q_len, prefix, num_prompts in PREFILL_SHAPES:
        seq_len = q_len + prefix
        b = make_batch(gen, [seq_len] * num_prompts, [q_len] * num_prompts, args.num_kv_heads, group,
                       args.head_dim, args.block_size, dtype, "cuda")
        # As the engine calls it: the new tokens' K/V written, then also handed over.
        write_kv_torch(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
        scale = args.head_dim ** -0.5

        def attend():
            return paged_attention_triton(b.query, b.kv_cache, b.meta, scale, config, new_kv=(b.key, b.value))

        out = attend()
        err = rel_error(out, twin_attention(b.query, b.kv_cache, b.meta, scale)) if check else 0.0
        ms = do_bench(attend, warmup=25, rep=200, return_mode="median")
        # visible keys summed over query rows: prefix for all, causal triangle for the new
        visible = num_prompts * (q_len * prefix + q_len * (q_len + 1) / 2)
        flops = 4 * visible * args.num_heads * args.head_dim
        tflops = flops / (ms * 1e-3) / 1e12
        cudnn_ms = _cudnn_prefill_ms(b, num_prompts, q_len, group) if reference and prefix == 0 else None
        rows.append(PrefillRow(query_len=q_len, prefix_len=prefix, ms=ms, tflops=tflops,
                               fraction_of_matmul=tflops / ceilings.matmul_tflops,
                               max_rel_error=err, num_prompts=num_prompts))
        if cudnn_ms:
            rows[-1].cudnn_tflops = flops / (cudnn_ms * 1e-3) / 1e12
            rows[-1].cudnn_fraction_of_matmul = rows[-1].cudnn_tflops / ceilings.matmul_tflops
        del b
        torch.cuda.empty_cache()
    return rows


def _cudnn_prefill_ms(b, num_prompts: int, q_len: int, group: int) -> Optional[float]:
    """torch's cuDNN attention, causal, over the same prompts' query, key and value
    (the KV heads repeated for the group); None where this torch or GPU lacks it."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    head_dim = b.query.shape[-1]

    def heads_first(rows: torch.Tensor) -> torch.Tensor:  # [tokens, heads, dim] -> [prompts, heads, q_len, dim]
        return rows.reshape(num_prompts, q_len, -1, head_dim).transpose(1, 2)

    q = heads_first(b.query)
    k = heads_first(b.key.repeat_interleave(group, dim=1))
    v = heads_first(b.value.repeat_interleave(group, dim=1))

    def attend():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    try:
        attend()
    except RuntimeError:  # no cuDNN attention for this GPU, dtype or torch build
        return None
    return do_bench(attend, warmup=25, rep=200, return_mode="median")


MIXED_SHAPES = ((255, 2048, 512, 1536), (63, 4096, 1024, 3072))  # decodes, ctx, chunk, prefix


def run_mixed(args: argparse.Namespace, ceilings: Ceilings) -> list[MixedRow]:
    import torch
    from triton.testing import do_bench

    from tandem.kernels.attention_triton import paged_attention_triton
    from tandem.kernels.paged_attention_torch import write_kv_torch
    from tandem.kernels.selfcheck import make_batch, rel_error, twin_attention

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gen = torch.Generator().manual_seed(2)
    group = args.num_heads // args.num_kv_heads
    token_bytes = 2 * args.num_kv_heads * args.head_dim * 2
    rows = []
    for decodes, context, chunk, prefix in MIXED_SHAPES:
        b = make_batch(gen, [context] * decodes + [chunk + prefix], [1] * decodes + [chunk],
                       args.num_kv_heads, group, args.head_dim, args.block_size, dtype, "cuda")
        write_kv_torch(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
        scale = args.head_dim ** -0.5

        def attend():
            return paged_attention_triton(b.query, b.kv_cache, b.meta, scale, new_kv=(b.key, b.value))

        out = attend()
        err = rel_error(out, twin_attention(b.query, b.kv_cache, b.meta, scale))
        ms = do_bench(attend, warmup=25, rep=200, return_mode="median")
        gbps = (decodes * context + chunk + prefix) * token_bytes / (ms * 1e-3) / 1e9
        rows.append(MixedRow(decodes=decodes, decode_context=context, chunk=chunk, prefix=prefix,
                             ms=ms, kv_gbps=gbps, fraction_of_copy=gbps / ceilings.copy_gbps,
                             max_rel_error=err))
    return rows


def worst_error_or_raise(rows: list[DecodeRow], what: str) -> float:
    """The largest relative error of a sweep's rows against the torch twin;
    raises above 2e-2, as run_sweep does: a fast wrong setting is no candidate."""
    worst = max(r.max_rel_error for r in rows)
    if worst > 2e-2:
        raise RuntimeError(f"{what}: relative error {worst:.1e} against the torch twin")
    return worst


def run_tile_sweep(bench: DecodeBench, args: argparse.Namespace, ceilings: Ceilings) -> list[dict]:
    """The decode kernel's tiles on the sweep shapes, splits and reduce as the defaults
    choose them: each row is the fraction of the copy bandwidth a tile setting reads KV at."""
    from dataclasses import replace

    from triton.runtime.errors import OutOfResources

    from tandem.kernels.attention_triton import DEFAULT_CONFIG, AttentionConfig, decode_tiles

    results = []
    base = decode_tiles(DEFAULT_CONFIG.decode, bench.kv_cache.dtype)
    for block_n in (32, 64, 128, 256):
        for warps in (1, 2, 4, 8):
            for stages in (2, 3, 4):
                # one tile for every grid, split or not
                d = replace(base, block_n=block_n, fp8_block_n=block_n, num_warps=warps, num_stages=stages,
                            single_num_warps=0, single_num_stages=0, single_block_n=0,
                            fp8_single_num_warps=0, fp8_single_num_stages=0, fp8_single_block_n=0)
                cfg = AttentionConfig(decode=d)
                try:
                    rows = [bench.run(b, c, cfg, check=True, same_size_copy=False) for b, c in args.sweep_shapes]
                except OutOfResources as exc:  # a tile that does not fit this GPU: say so, go on
                    print(f"tiles block_n={block_n} warps={warps} stages={stages}: {exc}", flush=True)
                    continue
                fracs = [r.kv_gbps / ceilings.copy_gbps for r in rows]
                worst = worst_error_or_raise(rows, str(d))
                results.append({"config": asdict(d), "shapes": args.sweep_shapes, "fractions": fracs,
                                "us": [r.us for r in rows], "max_rel_error": worst})
                print(f"tiles block_n={block_n} warps={warps} stages={stages}: "
                      + " ".join(f"{r.us:.0f}us/{f:.2f}" for r, f in zip(rows, fracs))
                      + f" err {worst:.1e}", flush=True)
    return results


def heads_outer(kv_cache):
    """The same values as kv_cache ([2, blocks, block_size, kv_heads, head_dim]),
    stored heads-outer ([2, blocks, kv_heads, block_size, head_dim] in memory)
    and seen through a view of kv_cache's shape: the kernels take strides."""
    return kv_cache.transpose(2, 3).contiguous().transpose(2, 3)


def decode_variant_grid() -> list[tuple[str, bool, bool]]:
    """(layout, grid_heads_first, values_after_scores), the engine's own first."""
    return [(layout, first, after) for layout in LAYOUTS for first in (False, True) for after in (False, True)]


def run_decode_variants(bench: DecodeBench, args: argparse.Namespace, ceilings: Ceilings) -> list[DecodeVariantRow]:
    from dataclasses import replace

    from tandem.kernels.attention_triton import DEFAULT_CONFIG, AttentionConfig

    engine_cache = bench.kv_cache
    caches = {"tokens-outer": engine_cache, "heads-outer": heads_outer(engine_cache)}
    results = []
    try:
        for layout, first, after in decode_variant_grid():
            bench.kv_cache = caches[layout]
            cfg = AttentionConfig(decode=replace(DEFAULT_CONFIG.decode, grid_heads_first=first,
                                                 values_after_scores=after))
            rows = [bench.run(b, c, cfg, check=True, same_size_copy=False) for b, c in args.sweep_shapes]
            worst = worst_error_or_raise(rows, f"{layout} heads_first={first} values_after_scores={after}")
            row = DecodeVariantRow(layout, first, after, list(args.sweep_shapes), [r.us for r in rows],
                                   [r.kv_gbps / ceilings.copy_gbps for r in rows], worst)
            results.append(row)
            print(f"variant {variant_name(row)}: " + " ".join(
                f"{b}x{c} {us:.0f}us/{f:.2f}" for (b, c), us, f in zip(row.shapes, row.us, row.fractions)),
                flush=True)
    finally:
        bench.kv_cache = engine_cache
    return results


def variant_name(row: DecodeVariantRow) -> str:
    return (f"{row.layout}, {'heads' if row.grid_heads_first else 'sequences'} first, "
            f"values {'after' if row.values_after_scores else 'with'} scores")


def run_sweep(bench: DecodeBench, args: argparse.Namespace, ceilings: Ceilings) -> list[dict]:
    from tandem.kernels.attention_triton import AttentionConfig, DecodeConfig, PrefillConfig

    results = []
    prefill_grid = () if args.skip_prefill else (
        (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3),
        (128, 128, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3))
    for block_m, block_n, warps, stages in prefill_grid:
        # The same tiles whichever of the two configs the shape's launch picks.
        tiles = PrefillConfig(block_m, block_n, warps, stages)
        cfg = AttentionConfig(prefill=tiles, long_prefill=tiles)
        rows = run_prefill(args, ceilings, cfg, check=False, reference=False)
        results.append({"prefill_config": asdict(cfg.prefill), "shapes": PREFILL_SHAPES,
                        "tflops": [r.tflops for r in rows]})
        print(f"sweep {asdict(cfg.prefill)} TFLOP/s "
              + " ".join(f"{r.tflops:.0f}" for r in rows), flush=True)
    # Warps and stages were swept before (4 warps, 3 stages won, docs/kernels.md);
    # the reduce's place and the split count matter most at small shapes.
    shapes = args.sweep_shapes
    for fused in (True, False):
        for block_n in (32, 64):
            for programs_per_sm in (2, 4, 8):
                cfg = AttentionConfig(decode=DecodeConfig(
                    block_n, programs_per_sm, 4, 3, fused_max_splits=(1 << 30) if fused else 0))
                fracs = []
                for batch, context in shapes:
                    row = bench.run(batch, context, cfg, check=True, same_size_copy=False)
                    if row.max_rel_error > 2e-2:
                        raise RuntimeError(f"{cfg.decode} at {batch}x{context}: relative error "
                                           f"{row.max_rel_error:.1e} against the torch twin")
                    fracs.append(row.kv_gbps / ceilings.copy_gbps)
                results.append({"config": asdict(cfg.decode), "shapes": shapes,
                                "fractions": fracs,
                                "geomean": math.exp(sum(map(math.log, fracs)) / len(fracs))})
                print(f"sweep fused={int(fused)} block_n={block_n} programs_per_sm="
                      f"{programs_per_sm} geomean={results[-1]['geomean']:.3f} "
                      + " ".join(f"{f:.2f}" for f in fracs), flush=True)
    return results


# ---------------------------------------------------------------- reporting


def print_report(report: Report) -> None:
    c = report.ceilings
    print(f"\n{report.device}; torch {report.torch_version}, triton {report.triton_version}")
    print(f"copy bandwidth {c.copy_gbps:.0f} GB/s (read + write), bf16 matmul "
          f"{c.matmul_tflops:.0f} TFLOP/s")
    s = report.shape
    print(f"decode attention, {s['dtype']}, {s['num_heads']} q heads / {s['num_kv_heads']} kv "
          f"heads, head_dim {s['head_dim']}, block {s['block_size']}: "
          f"KV GB/s (fraction of copy)")
    contexts = sorted({r.context for r in report.decode})
    print("batch \\ ctx " + "".join(f"{ctx:>15d}" for ctx in contexts))
    for batch in sorted({r.batch for r in report.decode}):
        cells = {r.context: r for r in report.decode if r.batch == batch}
        print(f"{batch:>11d} " + "".join(
            f"{cells[ctx].kv_gbps:>8.0f} ({cells[ctx].fraction_of_copy:.2f})" for ctx in contexts))
    if report.decode:
        print("the same bytes moved by a copy of that size, as a fraction of the large copy; "
              "then the kernel as a fraction of that copy")
        for batch in sorted({r.batch for r in report.decode}):
            cells = {r.context: r for r in report.decode if r.batch == batch}
            print(f"{batch:>11d} " + "".join(
                f"   {cells[ctx].same_size_copy_gbps / c.copy_gbps:>5.2f} {cells[ctx].fraction_of_same_size_copy:>5.2f}"
                for ctx in contexts))
        worst = max(r.max_rel_error for r in report.decode)
        print(f"max relative error vs torch twin: {worst:.1e}")
    if report.decode_variants:
        shapes = report.decode_variants[0].shapes
        print("decode variants, KV read as a fraction of copy; each shape's time over the engine's "
              "(the first row's)")
        print(f"{'':46}" + "".join(f"{f'{b}x{c}':>14}" for b, c in shapes))
        base = report.decode_variants[0].us
        for row in report.decode_variants:
            print(f"{variant_name(row):46}" + "".join(
                f"{f:>8.2f} {us / b_us:>5.2f}" for f, us, b_us in zip(row.fractions, row.us, base)))
    for r in report.mixed:
        print(f"mixed {r.decodes} decodes x {r.decode_context} + chunk {r.chunk} over prefix "
              f"{r.prefix}: {r.ms:.3f} ms, {r.kv_gbps:.0f} GB/s of KV ({r.fraction_of_copy:.2f} "
              f"of copy), err {r.max_rel_error:.1e}")
    for r in report.prefill:
        ref = (f"; cuDNN {r.cudnn_tflops:.0f} TFLOP/s ({r.cudnn_fraction_of_matmul:.2f})"
               if r.cudnn_tflops else "")
        print(f"prefill {r.num_prompts} x q_len {r.query_len} prefix {r.prefix_len}: {r.ms:.3f} ms, "
              f"{r.tflops:.0f} TFLOP/s ({r.fraction_of_matmul:.2f} of matmul), "
              f"err {r.max_rel_error:.1e}{ref}")


def run(args: argparse.Namespace) -> int:
    import torch
    import triton

    if not torch.cuda.is_available():
        print("tandem bench kernels needs a CUDA GPU: the kernels it measures run only there "
              "(the CPU path is the torch twin). Run it on a GPU machine.", file=sys.stderr)
        return 2
    if args.num_heads % args.num_kv_heads:
        print(f"--num-heads {args.num_heads} must be a multiple of --num-kv-heads "
              f"{args.num_kv_heads}", file=sys.stderr)
        return 2
    ceilings = measure_ceilings(args.copy_mib)
    report = Report(device=torch.cuda.get_device_name(0), torch_version=torch.__version__,
                    triton_version=triton.__version__,
                    shape={k: getattr(args, k) for k in ("num_heads", "num_kv_heads",
                                                         "head_dim", "block_size", "dtype",
                                                         "kv_cache_dtype")},
                    ceilings=ceilings)
    bench = DecodeBench(args)
    if args.sweep:
        report.sweep = run_sweep(bench, args, ceilings)
    if args.tile_sweep:
        report.sweep += run_tile_sweep(bench, args, ceilings)
    if args.decode_variants:
        report.decode_variants = run_decode_variants(bench, args, ceilings)
    for batch in args.batches:
        for context in args.contexts:
            row = bench.run(batch, context)
            row.fraction_of_copy = row.kv_gbps / ceilings.copy_gbps
            report.decode.append(row)
            print(f"decode batch={batch} context={context}: {row.us:.1f} us, "
                  f"{row.kv_gbps:.0f} GB/s, {row.fraction_of_copy:.2f} of copy "
                  f"(a copy of the same bytes: {row.same_size_copy_gbps / ceilings.copy_gbps:.2f}), "
                  f"err {row.max_rel_error:.1e}", flush=True)
    del bench
    torch.cuda.empty_cache()
    if not args.skip_prefill:
        report.prefill = run_prefill(args, ceilings)
        report.mixed = run_mixed(args, ceilings)
    with open(args.json, "w") as f:
        json.dump(asdict(report) | {"host": platform.node()}, f, indent=1)
    print_report(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
