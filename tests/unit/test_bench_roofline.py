"""`tandem bench throughput`'s compute roofline (bench/roofline.py): the
workload's FLOPs count each parameter once (a tied LM head is the embedding;
an MoE layer's experts by the share a token uses), and a run reports its
fraction beside tokens/s, measured in the same run."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import torch

from tandem.bench.roofline import Roofline, matmul_peak_flops, model_parameters, sustained_matmul_flops


def test_parameters_count_a_tied_head_once_and_leave_fp8_scales_out():
    embed = torch.nn.Embedding(100, 8)
    model = torch.nn.Module()
    model.embed = embed
    model.head = torch.nn.Linear(8, 100, bias=False)
    model.head.weight = embed.weight
    model.proj = torch.nn.Linear(8, 8, bias=False)
    model.proj.weight_scale = torch.nn.Parameter(torch.ones(8), requires_grad=False)
    assert model_parameters(model) == 100 * 8 + 8 * 8


def test_experts_count_only_the_top_k_a_token_passes_through():
    from tandem.engine.models.moe import MoEConfig, SparseMoeBlock

    block = SparseMoeBlock(16, MoEConfig(num_experts=8, top_k=2, intermediate_size=4, renormalize=True,
                                         weights_in_activation_dtype=True))
    block.experts.down_proj_scale = torch.nn.Parameter(torch.ones(8, 16), requires_grad=False)
    model = torch.nn.Sequential(block, torch.nn.Linear(16, 16, bias=False))
    experts = 8 * (2 * 4 * 16 + 16 * 4)
    assert model_parameters(model) == 16 * 8 + experts * 2 / 8 + 16 * 16


def test_fraction_is_the_roofline_time_over_the_measured_time():
    r = Roofline(peak_flops=1e12, workload_flops=5e11, seconds=2.0, precision="bfloat16")
    assert r.fraction == 0.25


def test_cpu_matmul_peak_is_a_positive_rate():
    peak = matmul_peak_flops(torch.device("cpu"), torch.float32)
    assert 1e8 < peak < 1e14


def test_the_sustained_rate_is_a_gpus_and_its_fraction_divides_by_it():
    """Back to back the GPU's power limit holds its clock down (bench/gpu_clocks.py);
    a CPU has no such rate to report."""
    assert math.isnan(sustained_matmul_flops(torch.device("cpu"), torch.float32))
    r = Roofline(peak_flops=1e12, workload_flops=5e11, seconds=2.0, precision="bfloat16", sustained_flops=0.5e12)
    assert r.fraction == 0.25 and r.sustained_fraction == 0.5


def test_bench_throughput_reports_the_roofline(tmp_path):
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "-m", "tandem.bench.throughput", "--num-prompts", "4",
                           "--input-len", "8", "16", "--output-len", "4", "--no-hf", "--admission-overcommit", "0.1",
                           "--output-json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "of the roofline" in proc.stdout
    # The engine line names the admission the run had, overcommit and tail share included.
    assert "admission reserve, overcommit 0.1, tail 0.1 (0 deferred, 0 admitted as a tail)" in proc.stderr
    engine = json.loads(out.read_text())["engine"]
    assert (engine["admission_overcommit"], engine["admission_tail"], engine["admissions_tail"]) == (0.1, 0.1, 0)
    roofline = json.loads(out.read_text())["roofline"]
    tokens = json.loads(out.read_text())["results"][0]
    assert roofline["precision"] == "float32"  # the CPU engine's dtype
    # SmolLM2-135M: 134.5M parameters (its LM head is its embedding)
    assert roofline["workload_flops"] == 2 * 134_515_008 * (tokens["input_tokens"] + tokens["output_tokens"])
    assert 0 < roofline["fraction"] < 1.5


def test_decode_steps_read_each_context_once_per_output_token_after_the_first():
    from tandem.bench.roofline import decode_kv_tokens

    # 10-token prompt, 4 outputs: token 0 from the prompt's step; steps for
    # tokens 1, 2, 3 attend over 11, 12 and 13 tokens.
    assert decode_kv_tokens([10], [4]) == 11 + 12 + 13
    assert decode_kv_tokens([10, 5], [1, 2]) == 0 + 6


def test_the_least_time_counts_the_lm_head_for_sampled_rows_and_no_input_embedding(tmp_path):
    from transformers import AutoConfig

    from tandem.bench.roofline import LeastTime, gemm_flops
    from tandem.engine.models.llama import LlamaFamilyForCausalLM
    from tests.support.hf_oracle import tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "llama")
    config = AutoConfig.from_pretrained(path)
    table = config.vocab_size * config.hidden_size
    for tied in (False, True):
        config.tie_word_embeddings = tied
        model = LlamaFamilyForCausalLM(config)
        body = sum(p.numel() for p in model.parameters()) - (table if tied else 2 * table)
        assert gemm_flops(model, tokens=100, sampled_tokens=7) == 2.0 * (body * 100 + table * 7)
    least = LeastTime(gemm_flops=6e12, sustained_flops=3e12, kv_read_bytes=1e12, copy_bandwidth=4e12)
    assert least.arithmetic_seconds == 2.0 and least.kv_read_seconds == 0.25 and least.seconds == 2.25
