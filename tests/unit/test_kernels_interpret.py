"""The Triton paged-attention kernels agree with their torch twins, on the CPU.

Triton's interpreter (TRITON_INTERPRET=1) runs the kernels' Python bodies
with numpy on CPU tensors. It must be switched on before triton is first
imported, and other tests may already have imported triton in this pytest
process, so the checks run in a child process (tandem.kernels.selfcheck)
and these tests assert on its exit status and report.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (test extra, x86-64 Linux)")


def run_selfcheck(*args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "tandem.kernels.selfcheck", "--device", "cpu",
                           *args], env=env, capture_output=True, text=True, timeout=240)


def run_check_module(module: str, timeout_s: int) -> str:
    """`python -m tandem.kernels.<module> --device cpu` under the interpreter,
    asserted to have exited 0: its standard output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", f"tandem.kernels.{module}", "--device", "cpu"],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    return proc.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [0])  # each seed costs CI 16 s under the interpreter
def test_triton_kernels_match_torch_twins_under_interpreter(seed: int) -> None:
    # Every GQA ratio (1, 3, 4) x head dim (64, 128) x block size (16, 32), dtypes
    # fp32/bf16/fp16/bf16 over an FP8 (e4m3) cache in turn, decode-only batches (split-KV with the reduce in
    # the same launch or in a second kernel, and the single-split path; each
    # called twice, the split counters left at zero), rows of length 0 as CUDA
    # graphs pad with, grids sized for far longer contexts than the batch has
    # (as a CUDA graph runs them), verifying batches (2 or 5 query tokens a
    # sequence through the split kernel, a split only the last query sees),
    # and mixed decode + prefill-with-prefix batches,
    # each also with its new tokens' K/V read through tensor descriptors from
    # strided views of a fused q|k|v row (the prompt launches' path on Hopper);
    # and the FP8 write over values from 1e-3 to 1e3, saturation included.
    proc = run_selfcheck("--size", "small", "--seed", str(seed))
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert "checked 50 cases, 0 failed" in proc.stdout, report


@pytest.mark.timeout(60)
def test_selfcheck_refuses_cpu_without_interpreter() -> None:
    proc = run_selfcheck("--size", "small", interpret=False)
    assert proc.returncode != 0
    assert "TRITON_INTERPRET=1" in proc.stderr


@pytest.mark.timeout(300)
def test_layer_op_kernels_match_torch_twins_under_interpreter() -> None:
    # RMSNorm (plain, with the residual add, per head on a strided view), rotary
    # embedding on views of a fused QKV row, SiLU-and-multiply, the one-row
    # linear layer's GEMV, the two-row GEMV (1, 2 and 3 rows) and the few-row
    # kernel (1, 5 and 16 rows); fp32/bf16/fp16.
    out = run_check_module("layer_ops_check", timeout_s=240)
    assert "checked 87 cases, 0 failed" in out, out


def test_fp32_prompt_launches_on_a_gpu_take_the_small_tiles_and_others_keep_theirs() -> None:
    # The 16-bit tiles over exact fp32 products took ptxas minutes on an H200
    # (attention_triton.AttentionConfig.fp32_prefill); the decode tiles stay.
    import torch

    from tandem.kernels.attention_triton import DEFAULT_CONFIG, prompt_tiles_for

    fp32 = prompt_tiles_for(DEFAULT_CONFIG, torch.float32, True)
    assert fp32.prefill == fp32.long_prefill == DEFAULT_CONFIG.fp32_prefill
    assert fp32.decode == DEFAULT_CONFIG.decode and fp32.long_prefill != DEFAULT_CONFIG.long_prefill
    for dtype, on_gpu in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
        assert prompt_tiles_for(DEFAULT_CONFIG, dtype, on_gpu) is DEFAULT_CONFIG, (dtype, on_gpu)


def test_decode_grids_over_an_fp8_cache_take_short_tiles_only_with_many_programs_an_sm() -> None:
    # A split grid (few sequences) keeps 128-token tiles and 4 warps; one that
    # does not split takes 2 warps, and 64-token tiles from 12 programs
    # (sequences times KV heads) an SM (DecodeConfig.fp8_single_block_n_from).
    # bf16 keeps 64 in all.
    from dataclasses import replace

    import torch

    from tandem.kernels.attention_triton import DEFAULT_CONFIG, decode_grid, decode_tiles
    from tandem.kernels.kv_cache_dtype import FP8_KV_DTYPE

    fp8 = decode_tiles(DEFAULT_CONFIG.decode, FP8_KV_DTYPE)
    few = decode_grid(1, 8, 4096, 132, fp8)
    assert few.num_splits > 1 and (few.block_n, few.num_warps) == (128, 4)
    for num_seqs, block_n in ((64, 128), (197, 128), (198, 64), (256, 64)):  # 12 an SM: 198 x 8 / 132
        grid = decode_grid(num_seqs, 8, 704, 132, fp8)
        assert grid.num_splits == 1 and (grid.block_n, grid.num_warps, grid.num_stages) == (block_n, 2, 2)
        assert grid.partition_size % grid.block_n == 0
    bf16 = decode_tiles(DEFAULT_CONFIG.decode, torch.bfloat16)
    assert decode_grid(256, 8, 704, 132, bf16).block_n == decode_grid(1, 8, 4096, 132, bf16).block_n == 64
    # a single-split tile that does not divide the split grids' tile is not used
    odd = replace(fp8, single_block_n=96)
    assert decode_grid(256, 8, 704, 132, odd).block_n == 128


@pytest.mark.timeout(120)
def test_fused_moe_kernels_match_torch_twin_under_interpreter() -> None:
    # Grouped gate/up and down GEMMs over expert-sorted rows: 2-8 experts,
    # top-k 1, 2 and 3, an expert with no rows, experts taking every row, one
    # token and none, 64-row tiles with padding; fp32 and bf16; each with FP8
    # (e4m3) experts too, their activations in the model dtype (W8A16) and
    # quantized per row (W8A8). Then the one-launch alignment against its torch
    # twin, value for value, at 8 routings up to its 4096-row limit, and the
    # one-launch routing at 5.
    out = run_check_module("fused_moe_check", timeout_s=100)
    assert "checked 55 cases, 0 failed" in out, out


@pytest.mark.timeout(120)
def test_fp8_triton_gemms_match_the_dequantizing_twin_under_interpreter() -> None:
    # The skinny GEMM (kernels/fp8_triton.py) and the activation quantizer at
    # 1-150 rows and the weight-only GEMV at 1-16, widths that are not
    # multiples of their tiles, with and without bias; fp32 and bf16.
    out = run_check_module("fp8_check", timeout_s=100)
    assert "38 cases, 0 failed" in out, out


# Run under the interpreter in a child (TRITON_INTERPRET must be set before
# triton is imported). A launch refused for its shared memory cannot happen
# on the CPU, so the child makes the tall tiles' launch raise Triton's own
# OutOfResources, as a GPU with too little shared memory does at compile.
TILE_CHOICE = r"""
import torch
from triton.runtime.errors import OutOfResources
import tandem.kernels.attention_triton as at
from tandem.kernels.attention_triton import AttentionConfig, PrefillConfig
from tandem.kernels.paged_attention_torch import write_kv_torch
from tandem.kernels.selfcheck import make_batch, rel_error, twin_attention

cfg = AttentionConfig(prefill=PrefillConfig(block_m=16, block_n=16), long_prefill=PrefillConfig(block_m=32, block_n=16))
launched, refuse = [], set()  # refuse: of "descriptors" (tall tiles with them), "tall" (tall tiles at all)
real = at.prefill_attention

def watched(*args, block_m, new_kv=None, **kwargs):
    launched.append((block_m, new_kv is not None))
    if block_m == 32 and ("tall" in refuse or ("descriptors" in refuse and new_kv is not None)):
        raise OutOfResources(1 << 17, 1 << 16, "shared memory")
    return real(*args, block_m=block_m, new_kv=new_kv, **kwargs)

at.prefill_attention = watched
gen = torch.Generator().manual_seed(0)
shape = dict(num_kv_heads=2, group=4, head_dim=16, block_size=16, dtype=torch.float32, device="cpu")
prompt = make_batch(gen, [40], [40], **shape)  # 40 tokens x 4 rows fill a 32-row tile
mixed = make_batch(gen, [30, 30, 30, 50], [1, 1, 1, 3], **shape)  # 6 tokens over 4 sequences
for b in (prompt, mixed):  # as the engine calls it: the new K/V in the cache and handed over
    write_kv_torch(b.key, b.value, b.kv_cache, b.meta.slot_mapping)

def attend(b):
    launched.clear()
    out = at.paged_attention_triton(b.query, b.kv_cache, b.meta, 0.25, cfg, new_kv=(b.key, b.value))
    err = rel_error(out, twin_attention(b.query, b.kv_cache, b.meta, 0.25))
    assert err < 1e-5, err
    return list(launched)

assert attend(prompt) == [(32, True)], launched
assert attend(mixed) == [(16, False)], launched  # short launches gather every tile
refuse.add("descriptors")
assert attend(prompt) == [(32, True), (32, False)], launched  # refused, then the same tiles gathered
assert attend(prompt) == [(32, False)], launched  # not tried again
refuse.add("tall")
assert attend(prompt) == [(32, False), (16, False)], launched  # then the short tiles
assert attend(prompt) == [(16, False)], launched
print("tile choice ok")
"""


def run_interpreted_script(script: str, timeout_s: int) -> str:
    """`python -c script` under the interpreter, asserted to have exited 0: its standard output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(120)
def test_prompts_take_the_tall_prefill_tiles_with_descriptors_and_fall_back_where_they_do_not_fit() -> None:
    assert "tile choice ok" in run_interpreted_script(TILE_CHOICE, timeout_s=100)


# The decode launch's warps and stages over each cache: the child (under the
# interpreter) records what paged_attention_triton hands the decode kernel,
# on a pretend GPU of two SMs, so four sequences fill the grid (one split)
# and one long sequence splits.
DECODE_TILES = r"""
import torch
import tandem.kernels.attention_triton as at
from tandem.kernels.kv_cache_dtype import FP8_KV_DTYPE
from tandem.kernels.selfcheck import make_batch, rel_error, twin_attention

at._num_sms = lambda device: 2
launched = []
real = at.decode_attention

def watched(*args, num_warps, num_stages, partition_size, **kwargs):
    max_seq_len = args[5]
    launched.append((num_warps, num_stages, -(-max_seq_len // partition_size)))
    return real(*args, num_warps=num_warps, num_stages=num_stages, partition_size=partition_size, **kwargs)

at.decode_attention = watched
gen = torch.Generator().manual_seed(0)
seen = {}
for cache_dtype in (FP8_KV_DTYPE, None):
    shape = dict(num_kv_heads=2, group=4, head_dim=16, block_size=16, dtype=torch.bfloat16, device="cpu",
                 cache_dtype=cache_dtype)
    for name, lens in (("many", [40, 7, 33, 20]), ("one long", [300])):
        b = make_batch(gen, lens, [1] * len(lens), **shape)
        launched.clear()
        out = at.paged_attention_triton(b.query, b.kv_cache, b.meta, 0.25)
        err = rel_error(out, twin_attention(b.query, b.kv_cache, b.meta, 0.25))
        assert err < 2e-2, (name, cache_dtype, err)
        seen[(cache_dtype is not None, name)] = launched[0]
print(seen)
assert seen[(True, "many")] == (2, 2, 1), seen  # FP8, whole contexts: 2-warp programs
assert seen[(True, "one long")][:2] == (4, 3) and seen[(True, "one long")][2] > 1, seen
assert seen[(False, "many")] == (4, 3, 1), seen  # bf16: the one default
assert seen[(False, "one long")][:2] == (4, 3) and seen[(False, "one long")][2] > 1, seen
print("decode tiles ok")
"""


@pytest.mark.timeout(150)
def test_an_fp8_cache_decodes_whole_contexts_in_2_warp_programs_and_split_ones_in_4() -> None:
    assert "decode tiles ok" in run_interpreted_script(DECODE_TILES, timeout_s=130)


# The decode kernel's grid and load orders (DecodeConfig.grid_heads_first,
# values_after_scores) over the engine's block layout and over a heads-outer
# one, read through a permuted view: each against the twin, for whole
# contexts (one split) and split ones (combined in the launch), bf16 and
# FP8 caches. The child records what each launch was handed, so a switch
# that never reaches the kernel fails too.
DECODE_VARIANTS = r"""
import dataclasses
import torch
import tandem.kernels.attention_triton as at
from tandem.bench.kernels import decode_variant_grid, heads_outer
from tandem.kernels.kv_cache_dtype import FP8_KV_DTYPE
from tandem.kernels.selfcheck import make_batch, rel_error, twin_attention

at._num_sms = lambda device: 2
handed = []
real = at.decode_attention

def watched(*args, **kwargs):
    handed.append((kwargs["heads_first"], kwargs["values_after_scores"], args[1].stride()))
    return real(*args, **kwargs)

at.decode_attention = watched
gen = torch.Generator().manual_seed(0)
checked = 0
# a heads-outer key cache's strides, as [blocks, block_size, kv_heads, head_dim]
heads_outer_strides = (16 * 2 * 16, 16, 16 * 16, 1)
for cache_dtype in (FP8_KV_DTYPE, None):
    shape = dict(num_kv_heads=2, group=4, head_dim=16, block_size=16, dtype=torch.bfloat16, device="cpu",
                 cache_dtype=cache_dtype)
    for name, lens in (("many", [40, 7, 33, 20]), ("one long", [300])):
        b = make_batch(gen, lens, [1] * len(lens), **shape)
        ref = twin_attention(b.query, b.kv_cache, b.meta, 0.25)
        for layout, first, after in decode_variant_grid():
            cache = b.kv_cache if layout == "tokens-outer" else heads_outer(b.kv_cache)
            assert torch.equal(cache.float(), b.kv_cache.float())
            cfg = at.AttentionConfig(decode=dataclasses.replace(
                at.DEFAULT_CONFIG.decode, grid_heads_first=first, values_after_scores=after))
            handed.clear()
            out = at.paged_attention_triton(b.query, cache, b.meta, 0.25, cfg)
            err = rel_error(out, ref)
            assert err < 2e-2, (name, cache_dtype, layout, first, after, err)
            assert handed[0][:2] == (first, after), handed
            assert (handed[0][2] == heads_outer_strides) == (layout == "heads-outer"), handed
            checked += 1
# `--decode-kernel` (bench/decode_switches.py) reaches a call without a config, as the engine's are
from tandem.bench.decode_switches import apply_decode_switches
apply_decode_switches(["heads-first", "values-after-scores"])
handed.clear()
out = at.paged_attention_triton(b.query, b.kv_cache, b.meta, 0.25)
assert handed[0][:2] == (True, True), handed
assert rel_error(out, ref) < 2e-2
print(f"decode variants ok: {checked}")
"""


@pytest.mark.timeout(200)
def test_decode_grid_and_load_orders_agree_with_the_twin_over_both_block_layouts() -> None:
    assert "decode variants ok: 32" in run_interpreted_script(DECODE_VARIANTS, timeout_s=180)


# --kv-cache-layout HND: the engine's cache is a transposed view of heads-outer
# storage (model_runner.zeroed_kv_cache). Under the interpreter, both Triton
# cache writes (with a padding slot) put every row where the NHD cache has it,
# and a prompt batch (prefix and new tokens, the prompt kernel's gathers)
# attends over it as the twin does over NHD.
HEADS_OUTER_CACHE = r"""
import torch
import tandem.kernels.attention_triton as at
from tandem.engine.model_runner import zeroed_kv_cache
from tandem.kernels.cache_write import write_kv_triton
from tandem.kernels.kv_cache_dtype import FP8_KV_DTYPE
from tandem.kernels.paged_attention_torch import write_kv_torch
from tandem.kernels.rotary_kv_write_triton import rotary_write_kv_triton
from tandem.kernels.selfcheck import make_batch, rel_error, twin_attention

gen = torch.Generator().manual_seed(0)
checked = 0
for cache_dtype in (torch.bfloat16, FP8_KV_DTYPE):
    shape = (2, 6, 16, 2, 16)  # [2, blocks, block_size, kv_heads, head_dim]
    nhd = zeroed_kv_cache(shape, cache_dtype, torch.device("cpu"))
    hnd = zeroed_kv_cache(shape, cache_dtype, torch.device("cpu"), "HND")
    assert hnd.shape == nhd.shape and not hnd.is_contiguous()
    assert hnd.stride()[2:] == (16, 16 * 16, 1), hnd.stride()  # a head's rows of a block side by side
    slots = torch.tensor([3, 17, 40, -1, 95, 64])
    k = torch.randn(6, 2, 16, generator=gen).to(torch.bfloat16)
    v = torch.randn(6, 2, 16, generator=gen).to(torch.bfloat16)
    for cache in (nhd, hnd):
        write_kv_triton(k, v, cache, slots)
    assert torch.equal(hnd.float(), nhd.float()), "write_kv_triton"
    twins = [zeroed_kv_cache(shape, cache_dtype, torch.device("cpu"), layout) for layout in ("NHD", "HND")]
    for twin in twins:
        write_kv_torch(k, v, twin, slots)
    assert torch.equal(twins[1].float(), twins[0].float()), "write_kv_torch"
    if cache_dtype == torch.bfloat16:  # the interpreter's FP8 conversion rounds otherwise than torch's
        assert torch.equal(twins[0], nhd), "write_kv_triton against its twin"
    q = torch.randn(6, 4, 16, generator=gen).to(torch.bfloat16)
    cos, sin = (torch.randn(6, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    outs = []
    for cache in (nhd, hnd):
        outs.append(rotary_write_kv_triton(q.clone(), k.clone(), v, cos, sin, cache, slots))
    assert torch.equal(hnd.float(), nhd.float()), "rotary_write_kv_triton"
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    checked += 3
for cache_dtype in (None, FP8_KV_DTYPE):
    b = make_batch(gen, [40, 70], [40, 23], num_kv_heads=2, group=2, head_dim=16, block_size=16,
                   dtype=torch.bfloat16, device="cpu", cache_dtype=cache_dtype)
    ref = twin_attention(b.query, b.kv_cache, b.meta, 0.25)
    hnd = zeroed_kv_cache(tuple(b.kv_cache.shape), b.kv_cache.dtype, torch.device("cpu"), "HND")
    hnd.copy_(b.kv_cache)
    err = rel_error(at.paged_attention_triton(b.query, hnd, b.meta, 0.25), ref)
    assert err < 2e-2, (cache_dtype, err)
    checked += 1
print(f"heads-outer cache ok: {checked}")
"""


@pytest.mark.timeout(200)
def test_cache_writes_and_prompt_attention_take_a_heads_outer_cache() -> None:
    assert "heads-outer cache ok: 8" in run_interpreted_script(HEADS_OUTER_CACHE, timeout_s=180)
