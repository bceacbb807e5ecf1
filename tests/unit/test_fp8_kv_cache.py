"""--kv-cache-dtype fp8: keys and values stored as e4m3 (kernels/kv_cache_dtype.py).

The CPU runs the torch twins; tests/unit/test_kernels_interpret.py checks
the Triton kernels against them on FP8 caches, and tests/gpu the GPU's.
"""
from __future__ import annotations

import pytest
import torch

from tandem.engine import LLM
from tandem.engine.config import ConfigError, EngineArgs
from tandem.kernels.paged_attention_torch import write_kv_torch
from tests.support.hf_oracle import tiny_model_dir
from tests.support.kv_scales import large_kv_model, teacher_forced_agreement


def test_the_write_rounds_to_the_nearest_e4m3_and_saturates_at_448():
    key = torch.tensor([[[1000.0, -1000.0, 31.625, 0.78125]]])  # [tokens, heads, head_dim]
    value = torch.tensor([[[448.0, -449.0, 1e-9, -0.3]]])
    cache = torch.zeros(2, 1, 4, 1, 4, dtype=torch.float8_e4m3fn)  # [K/V, blocks, block size, heads, dim]
    write_kv_torch(key, value, cache, torch.tensor([2]))
    # 31.625 rounds up into the next power of two; 0.78125 is a tie between 0.75 and 0.8125: to even.
    assert cache[0, 0, 2, 0].float().tolist() == [448.0, -448.0, 32.0, 0.75]
    assert cache[1, 0, 2, 0].float().tolist() == [448.0, -448.0, 0.0, -0.3125]
    assert not bool(cache.float().isnan().any())
    assert not bool(cache[:, 0, [0, 1, 3]].float().any()), "only slot 2 is written"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = tiny_model_dir(tmp_path_factory.mktemp("fp8-kv"), "llama")
    return path


def test_an_fp8_cache_holds_twice_the_blocks_of_bf16_in_the_same_memory_and_names_them_apart(tiny):
    runners = {}
    for kv in ("auto", "fp8"):
        llm = LLM(tiny, dtype="bfloat16", kv_cache_dtype=kv, cpu_kv_cache_gib=0.01)
        runners[kv] = llm.engine.runner
        llm.shutdown()
    bf16, fp8 = runners["auto"], runners["fp8"]
    assert bf16.kv_cache.dtype == torch.bfloat16 and fp8.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.layout.block_bytes * 2 == bf16.layout.block_bytes
    assert fp8.num_blocks == 2 * bf16.num_blocks
    # A store shared by both never hands one the other's blocks: other names, other headers.
    assert fp8.layout.model_key != bf16.layout.model_key
    assert fp8.layout.dtype_name == "float8_e4m3fn"


def test_fp8_kv_cache_smollm2_agrees_with_bf16_on_most_greedy_tokens():
    """Teacher forced, as FP8 weights are measured (tests/support/fp8_agreement.py).
    Measured 2026-11-29 on the dev machine: 365/384 (95.1%), against 356/384
    for FP8 weights and 98.4% for bf16 against itself in another batch. A
    cache whose bytes were read as another type scores near 0."""
    from tests.support.fp8_agreement import agreement_with_bf16

    agreed, n = agreement_with_bf16("cpu", "FP8 KV cache", kv_cache_dtype="fp8")
    assert agreed >= 0.90 * n


def test_an_unknown_kv_cache_dtype_is_refused_by_its_flag():
    with pytest.raises(ConfigError, match="--kv-cache-dtype: 'fp8_e5m2' is not one of auto, fp8, fp8_e4m3"):
        EngineArgs(kv_cache_dtype="fp8_e5m2").create_engine_config()


def test_an_fp8_cache_divides_by_the_checkpoints_kv_scales(tmp_path):
    """Keys and values past 448 saturate an FP8 cache of scale one; with the
    checkpoint's k_scale / v_scale the cache holds them divided (and attention
    multiplies back), and the engine picks the fp32 cache's tokens again.
    Measured on dev: 75/96 with the scales, 9/96 without."""
    plain, scaled = large_kv_model(tmp_path, scales=False), large_kv_model(tmp_path, scales=True)
    with_scales, n, key = teacher_forced_agreement(scaled, plain, kv_cache_dtype="fp8")
    without, _, plain_key = teacher_forced_agreement(plain, plain, kv_cache_dtype="fp8")
    assert with_scales >= 0.6 * n and without <= 0.3 * n, (with_scales, without, n)
    # Blocks divided by the scales are named apart from blocks of scale one.
    assert key.endswith("|kv=torch.float8_e4m3fn|kv-scales") and not plain_key.endswith("|kv-scales")
    # A cache in the model's dtype ignores the scales: every token the same.
    same, _, auto_key = teacher_forced_agreement(scaled, plain)
    assert same == n and "kv" not in auto_key.split("|", 1)[1]


def test_kv_scales_the_model_has_no_place_for_are_named_in_a_warning(tmp_path, caplog):
    """vLLM's names are read (<attention>.k_scale, .v_scale, or .kv_scale for
    both); a scale of a layer the model does not have is said, not dropped in
    silence; a scale that is not positive is an error naming it."""
    import logging

    from safetensors.torch import save_file

    from tandem.engine.models.llama import Attention

    path, _ = tiny_model_dir(tmp_path, "llama")
    save_file({"model.layers.0.self_attn.kv_scale": torch.tensor(0.5),
               "model.layers.1.self_attn.k_scale": torch.tensor([0.25, 2.0]),
               "model.layers.7.self_attn.v_scale": torch.tensor(3.0)}, f"{path}/kv_scales.safetensors")
    with caplog.at_level(logging.INFO, logger="tandem.engine.loader"):
        llm = LLM(path, kv_cache_dtype="fp8", num_blocks=16)
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]
        llm.shutdown()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.5, 0.5), (2.0, 1.0)]
    messages = [r.getMessage() for r in caplog.records if "KV cache scale" in r.getMessage()]
    assert any("2 KV cache scale tensors read" in m for m in messages), messages
    assert any("model.layers.7.self_attn.v_scale, 1 in all" in m for m in messages), messages
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}, f"{path}/kv_scales.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_scale: a KV cache scale must be a positive"):
        LLM(path, kv_cache_dtype="fp8", num_blocks=16)


def test_a_gpu_below_compute_capability_8_9_is_refused_by_the_flag(monkeypatch):
    from tandem.engine.fp8 import gpu_without_fp8
    from tandem.engine.model_runner import resolve_kv_cache_dtype

    cuda = torch.device("cuda", 0)  # never touched: the capability is what is asked
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert gpu_without_fp8(cuda) == "8.0" and gpu_without_fp8(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: .* this one is 8.0: use --kv-cache-dtype auto"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, cuda)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, cuda) == torch.float8_e4m3fn
