"""Checks every Triton kernel against its torch twin on random paged batches.

    python -m tandem.kernels.selfcheck --size small   # CPU: TRITON_INTERPRET=1
    python -m tandem.kernels.selfcheck --size full    # CUDA, full sizes

Each case draws a fresh cache full of random values, shuffled
(non-contiguous) block tables, GQA ratios, head dims, block sizes, context
lengths and batch shapes (decode-only, mixed decode + prefill with and
without a cached prefix, and verifying batches of the same few query
tokens a sequence), each cache of the query's dtype or of FP8 (e4m3,
--kv-cache-dtype fp8). write_kv must match bit for bit; attention must
match the twin within the query dtype's tolerance (relative L2 error).
Exit status 0 means every case passed. The interpreter must be switched on
before triton is first imported, which is why this runs as its own process.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import sys
import time
from dataclasses import dataclass, field

import torch

from tandem.kernels.kv_cache_dtype import FP8_KV_DTYPE, is_fp8, movable
from tandem.kernels.metadata import AttentionMetadata
from tandem.kernels.paged_attention_torch import paged_attention_torch, write_kv_torch

# Relative L2 error allowed against the fp32 twin. bf16/fp16 lose precision
# where the kernel rounds the softmax weights to the input dtype for P @ V.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (query dtype, cache dtype) of the cases, in turn: an FP8 cache serves bf16 models.
CASE_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
               (torch.float16, torch.float16), (torch.bfloat16, FP8_KV_DTYPE))


@dataclass
class Batch:
    """One random paged batch: q_lens[i] new tokens at the end of seq_lens[i]."""
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    kv_cache: torch.Tensor  # random everywhere: stale data must never leak in
    meta: AttentionMetadata
    q_lens: list[int] = field(default_factory=list)


def make_batch(gen: torch.Generator, seq_lens: list[int], q_lens: list[int], num_kv_heads: int,
               group: int, head_dim: int, block_size: int, dtype: torch.dtype,
               device: str, pad_tokens: int = 0, spare_blocks: int = 8,
               cache_dtype: torch.dtype | None = None) -> Batch:
    """A batch whose block tables are a random permutation of the cache's blocks;
    the cache of cache_dtype (None: dtype).

    pad_tokens extra query rows with slot -1 are appended (as a CUDA-graph
    padded batch has); they belong to no sequence.
    """
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + 1
    tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen)
    pos = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[pos:pos + n]
        pos += n
    slots = []
    for i, (s, q) in enumerate(zip(seq_lens, q_lens)):
        p = torch.arange(s - q, s)
        slots.append(tables[i, p // block_size] * block_size + p % block_size)
    slots.append(torch.full((pad_tokens,), -1, dtype=torch.long))
    slot_mapping = torch.cat(slots)
    num_tokens = int(slot_mapping.numel())
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)

    # Values are drawn on the device: a full-size cache holds ~1e9 elements.
    dev_gen = torch.Generator(device=device).manual_seed(
        int(torch.randint(0, 2**62, (1,), generator=gen)))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    num_heads = num_kv_heads * group
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(torch.int32).to(device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens))
    return Batch(query=rand(num_tokens, num_heads, head_dim),
                 key=rand(num_tokens, num_kv_heads, head_dim),
                 value=rand(num_tokens, num_kv_heads, head_dim),
                 kv_cache=rand(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype or dtype),
                 meta=meta, q_lens=list(q_lens))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def twin_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float) -> torch.Tensor:
    """The torch twin's answer, computed where the query lives.

    Multi-token batches on a GPU once went through a CPU copy of the whole
    cache, ~1e9 elements a full-size case (the twin's causal masks were CPU
    tensors, which SDPA refuses to mix with CUDA ones). The masks are now
    built on the query's device.
    """
    return paged_attention_torch(query, kv_cache, meta, scale)


def check_batch(batch: Batch, config=None) -> tuple[bool, float, str]:
    """Runs write_kv and attention through Triton and the twins; (ok, error, why)."""
    from tandem.kernels.attention_triton import paged_attention_triton
    from tandem.kernels.cache_write import write_kv_triton
    from tandem.kernels.common_triton import interpreted
    from tandem.kernels.decode_attention_triton import _split_counters

    ref_cache = batch.kv_cache.clone()
    write_kv_torch(batch.key, batch.value, ref_cache, batch.meta.slot_mapping)
    cache = batch.kv_cache.clone()
    write_kv_triton(batch.key, batch.value, cache, batch.meta.slot_mapping)
    why = write_mismatch(cache, ref_cache) or fused_write_mismatch(batch)
    if why:
        return False, float("inf"), f"write_kv: {why}"
    if is_fp8(cache.dtype) and interpreted():
        cache = ref_cache  # the same bits but for the interpreter's rounding (write_mismatch)
    num_real = sum(batch.q_lens)
    query = batch.query[:num_real]
    scale = query.shape[-1] ** -0.5
    out = paged_attention_triton(query, cache, batch.meta, scale, config)
    ref = twin_attention(query, ref_cache, batch.meta, scale)
    err = rel_error(out, ref)
    tol = TOLERANCE[query.dtype]
    if not err <= tol:
        return False, err, f"attention: relative error {err:.2e} > {tol:.0e}"
    uniform = batch.meta.uniform_queries  # the split kernel's too
    if not batch.meta.is_decode_only:
        ok, err2, why = check_new_kv_rows(batch, cache, ref, config)
        if not ok or not uniform:
            return ok, max(err, err2), why
        err = max(err, err2)
    # The fused split reduce keeps state between calls (its counters): a
    # second call must give the same bits and leave every counter at zero.
    again = paged_attention_triton(query, cache, batch.meta, scale, config)
    if not torch.equal(again, out):
        return False, err, "decode: a second call gave a different result"
    if any(int(c.count_nonzero()) for c in _split_counters.values()):
        return False, err, "decode: split counters left non-zero"
    return True, err, ""


def fused_write_mismatch(batch: Batch) -> str:
    """Why rotary_write_kv_triton (one launch) differs from rotary_triton
    then write_kv_triton over the batch's new rows, bit for bit: the rotated
    q and k, and the cache (over an FP8 cache also with a checkpoint's
    scales); empty if it does not. The two launches are checked against the
    twins elsewhere (check_batch, layer_ops_check)."""
    from tandem.kernels.cache_write import write_kv_triton
    from tandem.kernels.layer_ops_triton import rotary_triton
    from tandem.kernels.rotary_kv_write_triton import rotary_write_kv_triton

    q, k, v, slots = batch.query, batch.key, batch.value, batch.meta.slot_mapping  # padding rows too (slot -1)
    gen = torch.Generator().manual_seed(q.shape[0])
    angles = torch.rand(q.shape[0], q.shape[-1] // 2, generator=gen) * 6.3
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = (t.to(dtype=q.dtype, device=q.device) for t in (emb.cos(), emb.sin()))
    for k_scale, v_scale in ((1.0, 1.0), (0.37, 2.9)) if is_fp8(batch.kv_cache.dtype) else ((1.0, 1.0),):
        q1, k1 = rotary_triton(q.clone(), k.clone(), cos, sin)
        c1 = batch.kv_cache.clone()
        write_kv_triton(k1, v, c1, slots, k_scale, v_scale)
        c2 = batch.kv_cache.clone()
        q2, k2 = rotary_write_kv_triton(q.clone(), k.clone(), v, cos, sin, c2, slots, k_scale, v_scale)
        for name, a, b in (("q", q1, q2), ("k", k1, k2), ("cache", movable(c1), movable(c2))):
            if not torch.equal(a, b):
                return (f"rotary + write in one launch: {name} differs from the two launches' "
                        f"({int((a != b).sum())} elements, scales {k_scale} / {v_scale})")
    return ""


def write_mismatch(cache: torch.Tensor, ref: torch.Tensor) -> str:
    """Why the Triton write's cache differs from the twin's; empty if it does not.

    Bit for bit, but where Triton's interpreter (3.9) converts to FP8 in its
    own way: it rounds ties away from zero (the GPU and torch: to even), and
    where rounding up carries into the next power of two it gives half of it
    (31.6 -> 16, not 32). So under the interpreter an e4m3 element may be the
    twin's neighbour (codes one apart, same sign), or half the twin's where
    that is a power of two; the GPU run checks the bits.
    """
    from tandem.kernels.common_triton import interpreted

    differ = movable(cache) != movable(ref)
    if not bool(differ.any()):
        return ""
    if is_fp8(cache.dtype) and interpreted():
        got, want = cache[differ], ref[differ]
        got_code, want_code = (t.view(torch.uint8).int() for t in (got, want))
        neighbour = ((got_code >> 7) == (want_code >> 7)) & ((got_code & 0x7F) - (want_code & 0x7F)).abs().le(1)
        want_f = want.float()
        carry_flaw = (got.float() * 2 == want_f) & (torch.frexp(want_f.abs()).mantissa == 0.5)
        if bool((neighbour | carry_flaw | (got.float() == want_f)).all()):
            return ""
    return f"{int(differ.sum())} cache elements differ"


def check_new_kv_rows(batch: Batch, cache: torch.Tensor, ref: torch.Tensor,
                      config=None) -> tuple[bool, float, str]:
    """The prefill kernel reading this step's own tokens' K/V through tensor
    descriptors, with the prompt launches' tiles, against the twin's answer
    `ref`. The rows are strided views of one fused q|k|v row per token, as a
    fused projection leaves them; skipped where descriptors cannot be used
    (a GPU without TMA) or the tiles do not fit its shared memory."""
    from triton.runtime.errors import OutOfResources

    from tandem.kernels.attention_triton import DEFAULT_CONFIG, prompt_tiles_for
    from tandem.kernels.prefill_attention_triton import prefill_attention, tma_rows_usable

    if cache.dtype != batch.key.dtype:  # an FP8 cache: the engine reads every tile from it
        return True, 0.0, ""
    num_real = sum(batch.q_lens)
    query, key, value = (t[:num_real].flatten(1) for t in (batch.query, batch.key, batch.value))
    fused = torch.cat([query, key, value], dim=1)
    head_dim = batch.query.shape[2]
    q, *rows = (part.unflatten(1, (-1, head_dim))
                for part in fused.split([query.shape[1], key.shape[1], value.shape[1]], dim=1))
    if not all(tma_rows_usable(r) for r in rows):
        return True, 0.0, ""
    # the launches that take descriptors, with the engine's tiles for the query's dtype
    tiles = prompt_tiles_for(config or DEFAULT_CONFIG, batch.query.dtype, batch.query.is_cuda).long_prefill
    m = batch.meta
    out = torch.empty_like(q)
    try:
        prefill_attention(q, cache[0], cache[1], m.block_tables, m.seq_lens, m.query_start_loc,
                          m.max_query_len, head_dim ** -0.5, out, block_m=tiles.block_m,
                          block_n=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                          new_kv=tuple(rows))
    except OutOfResources:  # fp32 tiles staged whole: the engine gathers these (attention_triton.py)
        return True, 0.0, ""
    err = rel_error(out, ref)
    tol = TOLERANCE[q.dtype]
    return err <= tol, err, "" if err <= tol else f"attention, new K/V by descriptor: {err:.2e} > {tol:.0e}"


def check_fp8_write_range(gen: torch.Generator, dtype: torch.dtype, device: str) -> tuple[bool, float, str]:
    """The FP8 write over values from 1e-3 to 1e3 (rounding in every binade,
    e4m3's subnormals, saturation past 448) in the model's dtype, with a scale
    of one and with a checkpoint's scales (keys' and values' apart, not powers
    of two): the same bytes as the twin's (write_mismatch), into the engine's
    tokens-outer blocks and into heads-outer ones (--kv-cache-layout HND: a
    transposed view of [2, blocks, heads, block_size, head_dim])."""
    from tandem.kernels.cache_write import write_kv_triton

    n, heads, head_dim, block_size = 512, 2, 64, 16
    dev_gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    magnitude = torch.logspace(-3, 3, n, device=device)[:, None, None]
    key, value = ((torch.randn(n, heads, head_dim, generator=dev_gen, device=device) * magnitude).to(dtype)
                  for _ in range(2))
    slots = torch.randperm(n, generator=dev_gen, device=device)
    for (k_scale, v_scale), layout in itertools.product(((1.0, 1.0), (0.37, 2.9)), ("NHD", "HND")):
        ref = torch.zeros(2, n // block_size, block_size, heads, head_dim, device=device, dtype=FP8_KV_DTYPE)
        cache = (ref.clone() if layout == "NHD" else torch.zeros(
            2, n // block_size, heads, block_size, head_dim, device=device, dtype=FP8_KV_DTYPE).transpose(2, 3))
        write_kv_triton(key, value, cache, slots, k_scale, v_scale)
        write_kv_torch(key, value, ref, slots, k_scale, v_scale)
        why = write_mismatch(cache, ref)
        if why:
            return False, 0.0, f"FP8 write over 1e-3..1e3 ({layout} blocks), scales {k_scale} / {v_scale}: {why}"
    return True, 0.0, ""


def check_grid_above_lengths(gen: torch.Generator, dtype: torch.dtype, device: str,
                             config=None) -> tuple[bool, float, str]:
    """Decode with max_seq_len a bound far above the real lengths, as a CUDA
    graph captured for the longest context runs it: the grid has the bound's
    splits and each sequence spreads its context over all of them."""
    from dataclasses import replace

    from tandem.kernels.attention_triton import paged_attention_triton

    b = make_batch(gen, [700, 200, 37, 1, 64], [1] * 5, 2, 4, 64, 16, dtype, device)
    scale = 64 ** -0.5
    meta = replace(b.meta, max_seq_len=4096)
    out = paged_attention_triton(b.query, b.kv_cache, meta, scale, config)
    err = rel_error(out, twin_attention(b.query, b.kv_cache, b.meta, scale))
    tol = TOLERANCE[dtype]
    return err <= tol, err, "" if err <= tol else f"attention: relative error {err:.2e} > {tol:.0e}"


def check_padding_rows(gen: torch.Generator, dtype: torch.dtype, device: str,
                       config=None) -> tuple[bool, float, str]:
    """Decode rows of length 0 (a CUDA graph's padding) come out as zeros and leave
    the real rows' results as they are without them."""
    from tandem.kernels.attention_triton import paged_attention_triton

    b = make_batch(gen, [200, 37, 1], [1] * 3, 2, 4, 64, 16, dtype, device)
    scale = 64 ** -0.5
    real = paged_attention_triton(b.query, b.kv_cache, b.meta, scale, config)
    pad = 2
    m = b.meta
    padded = AttentionMetadata(
        slot_mapping=torch.cat([m.slot_mapping, m.slot_mapping.new_full((pad,), -1)]),
        query_start_loc=torch.arange(4 + pad, dtype=torch.int32, device=device),
        seq_lens=torch.cat([m.seq_lens, m.seq_lens.new_zeros(pad)]),
        block_tables=torch.cat([m.block_tables, m.block_tables[:1].expand(pad, -1)]),
        max_query_len=1, max_seq_len=m.max_seq_len,
        query_start_loc_cpu=list(range(4 + pad)), seq_lens_cpu=m.seq_lens_cpu + [0] * pad)
    query = torch.cat([b.query, b.query[:pad]])
    out = paged_attention_triton(query, b.kv_cache, padded, scale, config)
    if not torch.equal(out[:3], real):
        return False, float("inf"), "padding rows changed the real rows' results"
    if bool(out[3:].count_nonzero()):
        return False, float("inf"), "padding rows (length 0) are not zero"
    return True, 0.0, ""


def check_decode_graph(gen: torch.Generator, dtype: torch.dtype,
                       cache_dtype: torch.dtype) -> tuple[bool, float, str]:
    """The decode path under CUDA-graph capture: replay after changing lengths and tables."""
    from tandem.kernels.attention_triton import paged_attention_triton

    max_len, batch_size = 2048, 32
    lens = [max_len] + [int(x) for x in torch.randint(1, max_len, (batch_size - 1,), generator=gen)]
    b = make_batch(gen, lens, [1] * batch_size, 8, 4, 128, 16, dtype, "cuda", cache_dtype=cache_dtype)
    scale = 128 ** -0.5
    paged_attention_triton(b.query, b.kv_cache, b.meta, scale)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(b.query, b.kv_cache, b.meta, scale)
    worst = 0.0
    for _ in range(3):  # new lengths (<= the captured max) and new tables, same buffers
        new_lens = torch.randint(1, max_len + 1, (batch_size,), generator=gen).to(torch.int32)
        b.meta.seq_lens.copy_(new_lens)
        b.meta.seq_lens_cpu = new_lens.tolist()
        rows = torch.randperm(batch_size, generator=gen)
        b.meta.block_tables.copy_(b.meta.block_tables[rows.cuda()].clone())
        b.query.copy_(torch.randn(b.query.shape, generator=gen).to(dtype))
        graph.replay()
        ref = paged_attention_torch(b.query, b.kv_cache, b.meta, scale)
        worst = max(worst, rel_error(out, ref))
    tol = TOLERANCE[dtype]
    return worst <= tol, worst, "" if worst <= tol else f"graph replay error {worst:.2e}"


# The verify cases' rows per KV head the split kernel takes (DecodeConfig.max_uniform_rows).
UNIFORM_ROWS_CHECKED = 32


def small_cases(rng: random.Random):
    """Interpreter-sized cases: every GQA ratio x head dim x block size, cycling dtypes."""
    dtypes = itertools.cycle(CASE_DTYPES)
    for group, head_dim, block_size in itertools.product((1, 3, 4), (64, 128), (16, 32)):
        dtype, cache_dtype = next(dtypes)
        shape = dict(num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, cache_dtype=cache_dtype)
        decode_lens = [1, rng.randint(2, 40), rng.randint(100, 300)]
        yield "decode", shape, decode_lens, [1] * 3, 0
        # decode + prefill with a cached prefix + prefill from scratch + a padding row
        seq_lens = [rng.randint(1, 120), rng.randint(40, 200), rng.randint(2, 40)]
        q_lens = [1, rng.randint(2, 36), seq_lens[2]]
        q_lens[1] = min(q_lens[1], seq_lens[1])
        yield "mixed", shape, seq_lens, q_lens, 1
        # every sequence the same few query tokens (a verifying step): a fresh prompt of just
        # those; 33 tokens, whose last split (one token, of 16- or 32-token splits) only the
        # last query sees; a longer one
        q = rng.choice((2, 5))
        yield "verify", shape, [q, 33, rng.randint(100, 300)], [q] * 3, 0


def full_cases(rng: random.Random):
    """GPU-sized cases: contexts 1..4k, batches up to 256."""
    dtypes = itertools.cycle(CASE_DTYPES[1:] + CASE_DTYPES[:1])
    for (kv, group), head_dim, block_size in itertools.product(
            ((8, 4), (2, 3), (4, 1)), (64, 128), (16, 32)):
        dtype, cache_dtype = next(dtypes)
        shape = dict(num_kv_heads=kv, group=group, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, cache_dtype=cache_dtype)
        for batch_size in (1, 7, 64, 256):
            lens = [rng.randint(1, 4096) for _ in range(batch_size)]
            lens[0] = 4096 if batch_size > 1 else rng.choice((1, 4096))
            if batch_size > 2:
                lens[1] = 1
            yield "decode", shape, lens, [1] * batch_size, 0
        # mixed: decodes, chunked prefills over cached prefixes, a fresh prompt
        seq_lens = [rng.randint(1, 4096) for _ in range(12)]
        q_lens = [1] * 6 + [min(s, rng.randint(2, 512)) for s in seq_lens[6:11]]
        seq_lens[11] = 1500
        q_lens.append(1500)
        yield "mixed", shape, seq_lens, q_lens, 3
        q = 5  # a verifying step of k = 4
        for batch_size in (1, 7, 64):
            lens = [rng.randint(q, 4096) for _ in range(batch_size)]
            lens[0] = q if batch_size > 1 else 4096
            yield "verify", shape, lens, [q] * batch_size, 0


def run(size: str, seed: int, device: str, verbose: bool) -> int:
    from tandem.kernels.attention_triton import AttentionConfig, DecodeConfig, PrefillConfig

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if size == "small":
        cases, configs = small_cases(rng), [
            # many splits (each a tile of 32 or 16), combined in the one launch 4
            # at a time, or by the reduce kernel all at once; and the
            # single-split path; prefill tiles of each shape for the launches
            # of few rows per sequence and for those of many (long_prefill)
            AttentionConfig(DecodeConfig(block_n=32, programs_per_sm=1, reduce_chunk=4,
                                         fused_max_splits=1 << 30),
                            PrefillConfig(block_m=16, block_n=32), PrefillConfig(block_m=32, block_n=16)),
            AttentionConfig(DecodeConfig(block_n=16, programs_per_sm=1, reduce_chunk=64,
                                         fused_max_splits=0),
                            PrefillConfig(block_m=16, block_n=16), PrefillConfig(block_m=16, block_n=32)),
            # (over an FP8 cache its single-split grids take the short tiles at any batch)
            AttentionConfig(DecodeConfig(block_n=16, programs_per_sm=0, fp8_single_block_n_from=0),
                            PrefillConfig(block_m=32, block_n=16), PrefillConfig(block_m=32, block_n=32)),
        ]
    else:
        cases, configs = full_cases(rng), [None]
    failures, count, worst = 0, 0, {}
    t0 = time.perf_counter()
    # Triton's e4m3 conversions need compute capability 8.9+ (the engine refuses FP8 caches below).
    fp8_runs = device != "cuda" or torch.cuda.get_device_capability() >= (8, 9)
    for i, (kind, shape, seq_lens, q_lens, pad) in enumerate(cases):
        if is_fp8(shape["cache_dtype"]) and not fp8_runs:
            continue
        config = configs[i % len(configs)]
        batch = make_batch(gen, seq_lens, q_lens, device=device, pad_tokens=pad, **shape)
        if kind == "verify":  # marked uniform, with the split kernel's path for them on
            batch.meta.uniform_queries = True
            config = config or AttentionConfig()
            config = dataclasses.replace(config, decode=dataclasses.replace(
                config.decode, max_uniform_rows=UNIFORM_ROWS_CHECKED))
        ok, err, why = check_batch(batch, config)
        count += 1
        key = str(shape["dtype"]).removeprefix("torch.") + ("/fp8-kv" if is_fp8(shape["cache_dtype"]) else "")
        worst[key] = max(worst.get(key, 0.0), err)
        line = (f"{kind:6s} kv_heads={shape['num_kv_heads']} group={shape['group']} "
                f"head_dim={shape['head_dim']} block={shape['block_size']} {key:15s} "
                f"seqs={len(seq_lens)} max_len={max(seq_lens)} err={err:.2e}")
        if not ok:
            failures += 1
            print("FAIL", line, why, flush=True)
        elif verbose:
            print("ok  ", line, flush=True)
    decode_configs = [c for c in configs if c is not None] or [AttentionConfig()]
    decode_checks = (("decode with padding rows", check_padding_rows),
                     ("decode with a grid sized above the lengths", check_grid_above_lengths))
    for config in decode_configs:  # each reduce path, and the single split
        for dtype in (torch.float32, torch.bfloat16):
            for what, check in decode_checks:
                ok, err, why = check(gen, dtype, device, config)
                count += 1
                if not ok:
                    failures += 1
                    print("FAIL", what, config.decode, dtype, why, flush=True)
                elif verbose:
                    print(f"ok   {what} {dtype} err={err:.2e}", flush=True)
    if fp8_runs:
        for dtype in (torch.float32, torch.bfloat16):
            ok, err, why = check_fp8_write_range(gen, dtype, device)
            count += 1
            if not ok:
                failures += 1
                print("FAIL", why, dtype, flush=True)
            elif verbose:
                print(f"ok   FP8 write over 1e-3..1e3 from {dtype}", flush=True)
    if device == "cuda":
        for dtype, cache_dtype in CASE_DTYPES[1:]:
            if is_fp8(cache_dtype) and not fp8_runs:
                continue
            ok, err, why = check_decode_graph(gen, dtype, cache_dtype)
            count += 1
            if not ok:
                failures += 1
                print("FAIL decode under CUDA graph", dtype, cache_dtype, why, flush=True)
            elif verbose:
                print(f"ok   decode under CUDA graph {dtype} {cache_dtype} err={err:.2e}", flush=True)
    summary = " ".join(f"{k}={v:.1e}" for k, v in sorted(worst.items()))
    print(f"checked {count} cases, {failures} failed, worst error {summary}, "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.kernels.selfcheck",
        description="Compare the Triton paged-attention kernels with their torch twins. "
                    "On a CPU run it with TRITON_INTERPRET=1 in the environment.")
    parser.add_argument("--size", choices=("small", "full"), default="small",
                        help="small: interpreter-sized cases (CPU); full: contexts up to 4k "
                             "and batches up to 256 (needs CUDA)")
    parser.add_argument("--device", default=None,
                        help="torch device; default cuda if available, else cpu")
    parser.add_argument("--seed", type=int, default=0, help="seed for all random draws")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("on the CPU Triton runs only under its interpreter: "
                         "set TRITON_INTERPRET=1 in the environment")
    return run(args.size, args.seed, device, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
