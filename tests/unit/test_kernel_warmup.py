"""The kernel warm-up's plan (engine/kernel_warmup.py): every decode-kernel
choice a batch can make is among the warmed ones; the synthetic batches run
through a real model without touching the KV cache. Whether a GPU then
compiles nothing mid-serving is tests/gpu/test_kernel_warmup_gpu.py."""
from __future__ import annotations

import random

import pytest
import torch
import triton

from tandem.engine import kernel_warmup
from tandem.kernels.attention_triton import DEFAULT_CONFIG, decode_partition_size, decode_tiles, decode_variants
from tandem.kernels.decode_attention_triton import decode_choices


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, num_sms, max_model_len", [
    (32, 8, 128, 132, 8192),  # Llama-3-8B on an H100
    (16, 4, 128, 132, 8192),  # the same at TP=2
    (9, 3, 64, 78, 2048),  # SmolLM2-135M, another SM count
    (8, 1, 64, 16, 4096),
])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8-kv-cache"])
def test_every_decode_choice_a_batch_makes_is_warmed(monkeypatch, num_heads, num_kv_heads, head_dim,
                                                     num_sms, max_model_len, cache_dtype):
    from tandem.kernels import attention_triton

    monkeypatch.setattr(attention_triton, "_num_sms", lambda device: num_sms)
    max_num_seqs = 512
    d = decode_tiles(DEFAULT_CONFIG.decode, cache_dtype)  # an FP8 cache's tiles hold more tokens
    variants = decode_variants(num_heads, num_kv_heads, head_dim, max_model_len, max_num_seqs,
                               torch.device("cpu"), cache_dtype=cache_dtype)
    group = num_heads // num_kv_heads

    def choices_of(num_seqs: int, max_seq_len: int):
        # what decode_attention computes for such a batch
        partition = decode_partition_size(num_seqs, num_kv_heads, max_seq_len, num_sms, d)
        splits = max(1, triton.cdiv(max_seq_len, partition))
        num_warps, _, block_n = d.launch_tiles(splits, num_seqs * num_kv_heads / num_sms)
        return decode_choices(splits, group, head_dim, d.reduce_chunk, d.fused_max_splits, num_warps, block_n)

    rng = random.Random(0)
    batches = [(rng.randint(1, max_num_seqs), rng.randint(1, max_model_len)) for _ in range(3000)]
    batches += [(n, length) for n in (1, 2, 3, 4) for length in range(1, max_model_len + 1, 7)]
    for n, length in batches:
        assert choices_of(n, length) in variants, (n, length)
    # each warm-up batch makes the choice it stands for
    for key, (n, length) in variants.items():
        assert n <= max_num_seqs and length <= max_model_len
        assert choices_of(n, length) == key
    assert any(k.single for k in variants) and any(k.fused for k in variants)
    if cache_dtype == torch.float8_e4m3fn:  # 512 sequences reach the short tiles' programs an SM
        assert {k.block_n for k in variants if k.single} == {d.block_n, d.single_block_n}


def test_prompt_token_counts_cover_one_multiples_of_16_and_others():
    counts = kernel_warmup.prompt_token_counts(8192)
    assert counts[:3] == [1, 2, 3] and counts[-1] == 8192
    assert {16, 17, 64, 65, 4096, 4097} <= set(counts)
    assert kernel_warmup.prompt_token_counts(100)[-1] == 100
    assert max(kernel_warmup.prompt_token_counts(100)) == 100


def test_prompt_batches_respect_the_model_length():
    batch = kernel_warmup.prompt_batch(5000, 2048)
    assert batch.query_lens == (2048, 2048, 904) == batch.seq_lens
    assert batch.num_tokens == 5000


def test_warm_up_batches_run_through_the_model_and_leave_the_cache_alone(tmp_path):
    from tandem.engine import LLM
    from tests.support.hf_oracle import tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "qwen3_moe")
    llm = LLM(path, device="cpu", num_blocks=64, max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=256)
    try:
        runner = llm.engine.runner
        batches = kernel_warmup.warmup_batches(
            num_heads=runner.num_heads, num_kv_heads=runner.layout.num_kv_heads,
            head_dim=runner.layout.head_dim, max_model_len=512, max_num_seqs=8,
            max_num_batched_tokens=256, device=runner.device)
        decodes = [b for b in batches if max(b.query_lens) == 1 and max(b.seq_lens) > 64]
        assert len(decodes) >= 3, "no decode batches of several splits"
        assert any(b.num_tokens == 256 for b in batches)
        runner.kv_cache.normal_()  # any values: the warm-up must neither write nor need zeros
        before = runner.kv_cache.clone()
        report = kernel_warmup.warm_up(runner.model, runner.kv_caches, batches, runner.block_size,
                                       runner.device)
        assert report.batches == len(batches)
        assert torch.equal(runner.kv_cache, before)
    finally:
        llm.shutdown()


def test_the_engine_flag_turns_it_off():
    import argparse

    from tandem.engine.config import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    on = EngineArgs.from_cli_args(parser.parse_args(["--model", "m"]))
    off = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--no-kernel-warmup"]))
    assert on.create_engine_config().kernel_warmup is True
    assert off.create_engine_config().kernel_warmup is False
    assert off.to_cli_args() == ["--model", "m", "--no-kernel-warmup"]
