"""The Triton paged attention op: picks the decode or the prefill kernel and their tiles.

Twin: `paged_attention_torch` (same signature, same result up to rounding).
Decode-only batches (max_query_len == 1) go to the split-KV kernel in
decode_attention_triton.py; everything else (prefill, chunked prefill with a
cached prefix, mixed decode + prefill) to prefill_attention_triton.py.

Nothing here reads a device tensor on the host: tile and grid choices depend
only on shapes and the host ints meta.max_seq_len / max_query_len, so the
decode path can be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
from triton.runtime.errors import OutOfResources

from tandem.kernels.cache_write import _check_head_dim
from tandem.kernels.decode_attention_triton import DecodeChoices, decode_attention, decode_choices, num_splits_of
from tandem.kernels.kv_cache_dtype import is_fp8
from tandem.kernels.metadata import AttentionMetadata
from tandem.kernels.prefill_attention_triton import prefill_attention, tma_rows_usable

log = logging.getLogger(__name__)

# Assumed when no CUDA device can be asked (the CPU interpreter): an H100 SXM.
DEFAULT_NUM_SMS = 132


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64  # KV tokens per inner tile
    # Aim for this many programs per SM when splitting the context; splitting
    # further costs partial-result traffic and a longer reduce. 0: never split.
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 3
    reduce_chunk: int = 64  # at most this many partial results combined per step
    # Combine the splits inside the one launch (the last program of each
    # sequence and KV head does it) when the grid has at most this many, else
    # in a second kernel; 0: never. One program combining many splits costs
    # more than the launch it saves: on the H100 fusing won at 2-8 splits and
    # lost at 16-32 (docs/kernels.md, version 6).
    fused_max_splits: int = 8
    # A grid of one split (each program a whole context: many sequences)
    # launches with these warps and stages instead; 0: num_warps, num_stages.
    single_num_warps: int = 0
    single_num_stages: int = 0
    # ... and with tiles of single_block_n tokens where it has at least
    # single_block_n_from programs (sequences times KV heads) an SM; 0:
    # block_n. Not used unless it divides block_n (the host's partitions
    # are whole block_n tiles).
    single_block_n: int = 0
    single_block_n_from: int = 0
    # The tiles over an FP8 cache (decode_tiles): 128 tokens of 1-byte
    # elements, and 2-warp, 2-stage programs where the grid does not split.
    # Widened to fp16, a 128-token tile's keys and values hold 4-warp programs
    # to 2 an SM by registers (207 a thread), which waited on their loads at
    # half the copy bandwidth; 2-warp programs fit twice as many, and read
    # 1.25x faster at 256 x 512 and 256 x 2048, while split grids (a few
    # sequences) ran faster with 4 warps. From about 16 programs an SM
    # (Llama-3-8B's 8 KV heads at 256 sequences on 132 SMs), 64-token tiles
    # took 4-15% less time than 128 at contexts of 520-1280; at 4 and 8 an
    # SM (64 and 128 sequences) 12-15% more (H200, docs/benchmarks.md). 12
    # lies between the measured sides.
    fp8_block_n: int = 128
    fp8_single_num_warps: int = 2
    fp8_single_num_stages: int = 2
    fp8_single_block_n: int = 64
    fp8_single_block_n_from: int = 12
    # Batches marked uniform (meta.uniform_queries: every sequence the same
    # few query tokens, a verifying graph's 1 + k rows) take the split kernel
    # too, while their rows per KV head (tokens times the GQA group) fit
    # this; 0: never (the prompt kernel). 32 holds k = 7 drafts at a group of
    # 4 (an 8B Llama) and is what selfcheck's verify cases check. SmolLM2's
    # batch-1 verifying graph (k = 4) took 737.8 us against 904.3 with the
    # prompt kernel, one lease (H200, docs/kernels.md, version 18).
    max_uniform_rows: int = 32
    # The decode kernel's grid order and load order (decode_attention_triton,
    # HEADS_FIRST and VALUES_AFTER_SCORES), each a way to lift an FP8 cache's
    # reads from 0.68-0.75 of the copy bandwidth; off until `tandem bench
    # kernels --decode-variants` measures them on a GPU (docs/kernels.md).
    grid_heads_first: bool = False
    values_after_scores: bool = False

    def launch_tiles(self, num_splits: int, programs_per_sm: float) -> tuple[int, int, int]:
        """(num_warps, num_stages, block_n) of a grid of num_splits splits whose
        sequences times KV heads are programs_per_sm an SM."""
        if num_splits == 1:
            short = (self.single_block_n and self.block_n % self.single_block_n == 0
                     and programs_per_sm >= self.single_block_n_from)
            return (self.single_num_warps or self.num_warps, self.single_num_stages or self.num_stages,
                    self.single_block_n if short else self.block_n)
        return self.num_warps, self.num_stages, self.block_n


@functools.lru_cache(maxsize=None)  # asked by every eager decode attention call: once per config
def decode_tiles(cfg: DecodeConfig, cache_dtype: Optional[torch.dtype]) -> DecodeConfig:
    """The decode settings for a cache of cache_dtype: an FP8 cache's own tiles
    (the fp8_* fields)."""
    if cache_dtype is not None and is_fp8(cache_dtype):
        return dataclasses.replace(cfg, block_n=cfg.fp8_block_n, single_num_warps=cfg.fp8_single_num_warps,
                                   single_num_stages=cfg.fp8_single_num_stages,
                                   single_block_n=cfg.fp8_single_block_n,
                                   single_block_n_from=cfg.fp8_single_block_n_from)
    return cfg


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 64  # query rows per program
    block_n: int = 64  # KV tokens per inner tile
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class AttentionConfig:
    decode: DecodeConfig = DecodeConfig()
    # Launches with few query rows per sequence: decodes beside a prompt chunk,
    # where each decode's program fills only GROUP rows of its tile, so a
    # taller tile is mostly wasted work (docs/benchmarks.md, 2026-11-27).
    prefill: PrefillConfig = PrefillConfig()
    # Launches whose sequences fill a tall tile on average (prompts): a taller
    # tile reuses each KV tile it loads over more query rows. With the new
    # tokens' tiles read through tensor descriptors, 128 x 128 tiles in 3
    # stages ran 1.4-1.5x faster than 128 x 64 in 2 over the block table, and
    # over the block table alone they matched it (H200, docs/kernels.md,
    # version 9).
    long_prefill: PrefillConfig = PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    # Both kinds of prompt launch over fp32 queries on a GPU (the exact
    # checks: fp32 products are "ieee", CUDA-core FMAs, common_triton.py).
    # The 16-bit tiles unroll into code that ptxas takes minutes over (H200,
    # head_dim 128: over 190 s for one batch, first on the 128 x 128 tiles,
    # then on the 64 x 64 ones; docs/benchmarks.md, the thirty-first session).
    fp32_prefill: PrefillConfig = PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)


DEFAULT_CONFIG = AttentionConfig()


def prompt_tiles_for(cfg: AttentionConfig, dtype: torch.dtype, on_gpu: bool) -> AttentionConfig:
    """cfg with fp32_prefill for both prompt launches where the query is fp32
    on a GPU; cfg itself otherwise (no hashing of cfg on the 16-bit path)."""
    return _with_fp32_tiles(cfg) if dtype == torch.float32 and on_gpu else cfg


@functools.lru_cache(maxsize=None)
def _with_fp32_tiles(cfg: AttentionConfig) -> AttentionConfig:
    return dataclasses.replace(cfg, prefill=cfg.fp32_prefill, long_prefill=cfg.fp32_prefill)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                          cfg: DecodeConfig) -> int:
    """Tokens per split for a max_seq_len context: enough splits to give every
    SM work, none shorter than a tile. It sets the grid's split count; the
    kernel then cuts each sequence, however short, into that many partitions
    of whole tiles (decode_attention_triton.py).

    A power of two times block_n, so a growing max_seq_len changes it (and the
    grid's third dimension) rarely.
    """
    programs = max(1, num_seqs * num_kv_heads)
    want_splits = max(1, triton.cdiv(cfg.programs_per_sm * num_sms, programs))
    tiles = triton.cdiv(max(max_seq_len, 1), want_splits * cfg.block_n)
    return cfg.block_n * triton.next_power_of_2(tiles)


class DecodeGrid(NamedTuple):
    partition_size: int  # tokens per split (decode_partition_size)
    num_splits: int  # the grid's split count
    num_warps: int  # of such a grid (DecodeConfig.launch_tiles)
    num_stages: int
    block_n: int


def decode_grid(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                cfg: DecodeConfig) -> DecodeGrid:
    """The decode launch of a batch: its splits, and the tiles of that grid."""
    partition = decode_partition_size(num_seqs, num_kv_heads, max_seq_len, num_sms, cfg)
    splits = num_splits_of(max_seq_len, partition)
    return DecodeGrid(partition, splits, *cfg.launch_tiles(splits, num_seqs * num_kv_heads / num_sms))


def decode_variants(num_heads: int, num_kv_heads: int, head_dim: int, max_model_len: int,
                    max_num_seqs: int, device: torch.device,
                    config: AttentionConfig | None = None,
                    cache_dtype: Optional[torch.dtype] = None) -> dict[DecodeChoices, tuple[int, int]]:
    """Every set of decode-kernel choices a decode batch of at most
    max_num_seqs sequences, none longer than max_model_len, makes on this
    device over a cache of cache_dtype; each with a (num_seqs, max_seq_len)
    that makes it, the smallest batch first. A Triton compile each:
    kernel_warmup makes them all at start."""
    d = decode_tiles((config or DEFAULT_CONFIG).decode, cache_dtype)
    num_sms = _num_sms(device)
    group = num_heads // num_kv_heads
    found: dict[DecodeChoices, tuple[int, int]] = {}
    # The batch size acts only through the split count it wants and the tile
    # a grid of one split would take: one size for each.
    wanted: set[tuple[int, int]] = set()
    for num_seqs in range(1, max_num_seqs + 1):
        want = triton.cdiv(d.programs_per_sm * num_sms, num_seqs * num_kv_heads)
        single_tile = d.launch_tiles(1, num_seqs * num_kv_heads / num_sms)[2]
        if (want, single_tile) in wanted:
            continue
        wanted.add((want, single_tile))
        # The split count is constant between multiples of block_n (partitions are
        # multiples of it): one length in each such span, its end.
        for length in range(d.block_n, max_model_len + d.block_n, d.block_n):
            length = min(length, max_model_len)
            grid = decode_grid(num_seqs, num_kv_heads, length, num_sms, d)
            key = decode_choices(grid.num_splits, group, head_dim, d.reduce_chunk, d.fused_max_splits,
                                 grid.num_warps, grid.block_n)
            found.setdefault(key, (num_seqs, length))
    return found


def paged_attention_triton(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, config: AttentionConfig | None = None,
                           new_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Attention of query [num_tokens, num_heads, head_dim] over the paged cache.

    The new tokens' K/V must already be in the cache (write_kv first).
    kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim], its head_dim
    dense and its blocks in either layout (the kernels take strides: the
    engine's tokens-outer blocks, or heads-outer ones seen through a
    transposed view, --kv-cache-layout HND).
    new_kv: optionally the same K/V rows [num_tokens, num_kv_heads, head_dim]
    that write_kv wrote. Prompt launches read their own tokens' tiles from
    them through tensor descriptors where the GPU has TMA (tma_rows_usable),
    instead of gathering every tile through the block table.
    """
    cfg = config or DEFAULT_CONFIG
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    _check_head_dim(head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}; check the model config")
    if query.stride(2) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if meta.is_decode_only and num_tokens == meta.num_seqs:
        # One query row per sequence: row i belongs to sequence i.
        return _split_decode(query, key_cache, value_cache, meta, scale, out, cfg.decode, 1)
    q_len, group = meta.max_query_len, num_heads // num_kv_heads
    if (meta.uniform_queries and 1 < q_len and num_tokens == meta.num_seqs * q_len
            and q_len * group <= cfg.decode.max_uniform_rows):
        # Every sequence q_len rows, its last tokens, in order: the split kernel
        # reads each KV tile once for all of them, where the prompt kernel runs
        # one program per (sequence, KV head) along the whole context.
        return _split_decode(query, key_cache, value_cache, meta, scale, out, cfg.decode, q_len)
    cfg = prompt_tiles_for(cfg, query.dtype, query.is_cuda)
    # Chosen from host ints only (a captured graph replays the same choice).
    if num_tokens * group >= cfg.long_prefill.block_m * meta.num_seqs:
        # Over an FP8 cache the new tokens' tiles come from the cache too: the prompt
        # then attends to the rounded values its decodes will read.
        if new_kv is not None and not all(tma_rows_usable(rows) and rows.dtype == key_cache.dtype
                                          for rows in new_kv):
            new_kv = None
        # Descriptors stage whole tiles in shared memory: where that does not
        # fit, the same tiles gathered through the block table may.
        for kv in (new_kv, None) if new_kv is not None else (None,):
            long_tiles = (query.device, query.dtype, head_dim, cfg.long_prefill, kv is not None)
            if long_tiles in _LONG_TILES_TOO_BIG:
                continue
            try:
                return _prefill(query, key_cache, value_cache, meta, scale, out, cfg.long_prefill, kv)
            except OutOfResources as exc:
                _LONG_TILES_TOO_BIG.add(long_tiles)
                log.info("prefill attention: %s%s does not fit this GPU for %s, head_dim %d (%s)",
                         cfg.long_prefill, " with descriptors" if kv is not None else "", query.dtype,
                         head_dim, exc)
    # Short launches (decodes beside a chunk) keep the block table for every
    # tile: the descriptors were measured on prompts only.
    return _prefill(query, key_cache, value_cache, meta, scale, out, cfg.prefill)


def _split_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, out: torch.Tensor, cfg: DecodeConfig,
                  query_len: int) -> torch.Tensor:
    """The split decode kernel over query_len query rows a sequence."""
    d = decode_tiles(cfg, key_cache.dtype)
    grid = decode_grid(meta.num_seqs, key_cache.shape[2], meta.max_seq_len, _num_sms(query.device), d)
    return decode_attention(query, key_cache, value_cache, meta.block_tables,
                            meta.seq_lens, meta.max_seq_len, scale, out,
                            partition_size=grid.partition_size, block_n=grid.block_n,
                            num_warps=grid.num_warps, num_stages=grid.num_stages,
                            reduce_chunk=d.reduce_chunk, fused_max_splits=d.fused_max_splits,
                            query_len=query_len, heads_first=d.grid_heads_first,
                            values_after_scores=d.values_after_scores)


# (device, dtype, head_dim, tiles, with descriptors) whose long-prefill tiles
# need more shared memory than the GPU has: Triton refuses them at their first
# launch (before the engine serves: engine/kernel_warmup.py). Compiled by
# Triton 3.9, the 128 x 128 tiles in 3 stages over bf16 need, at head_dim 128:
# 225 KiB with descriptors (sm90, which allows 227), 64 KiB gathered (sm80,
# sm89); at head_dim 256: 449 KiB with descriptors, 160 KiB gathered, which
# fits an A100 (164) but not the 99 KiB of sm89 GPUs (L4, L40), where the
# short tiles (72 KiB) serve.
_LONG_TILES_TOO_BIG: set[tuple] = set()


def _prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             meta: AttentionMetadata, scale: float, out: torch.Tensor, tiles: PrefillConfig,
             new_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    return prefill_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                             meta.query_start_loc, meta.max_query_len, scale, out,
                             block_m=tiles.block_m, block_n=tiles.block_n, num_warps=tiles.num_warps,
                             num_stages=tiles.num_stages, new_kv=new_kv)
