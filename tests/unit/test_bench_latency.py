"""`tandem bench latency` on the CPU with a tiny preset and a tokenizer: one row
per batch size, numbers that agree with each other, staggered prompt lengths,
and host time that includes the update step's detokenizing."""
import dataclasses
import json
import subprocess
import sys

import pytest


def test_latency_bench_writes_consistent_rows(tmp_path):
    out = tmp_path / "latency.json"
    steps = 4
    subprocess.run([sys.executable, "-m", "tandem.bench.latency", "--preset", "llama-3-tiny", "--device", "cpu",
                    "--tokenizer", "smollm2", "--batch-sizes", "1,20", "--context", "40", "--steps", str(steps),
                    "--output-json", str(out)],
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 20] and result["tokenizer"] is True
    for r in result["rows"]:
        assert r["floor_ms"] > 0 and r["step_ms"] > 0
        assert abs(r["ratio"] - r["step_ms"] / r["floor_ms"]) < 1e-6
        assert r["period_ms"] > 0 and abs(r["period_ratio"] - r["period_ms"] / r["floor_ms"]) < 1e-6
        assert abs(r["tokens_per_s"] - r["batch"] / (r["step_ms"] / 1e3)) < 1e-6 * r["tokens_per_s"]
        assert 0 < r["schedule_ms"] and 0 < r["prepare_ms"] and 0 < r["update_ms"]
        assert r["host_ms"] >= max(r["schedule_ms"], r["prepare_ms"], r["update_ms"]) and r["host_mean_ms"] > 0
        assert r["gpu_idle_ms"] is None and r["gpu_idle_max_ms"] is None  # CUDA events: GPU runs only
        # The roof bounds the GEMMs by the matmul peak as well as by their bytes: never under the floor
        assert r["roof_ms"] >= r["floor_ms"] and abs(r["period_roof_ratio"] - r["period_ms"] / r["roof_ms"]) < 1e-6
        assert r["clocks"] is None  # nvidia-smi's samples: GPU runs only
    assert result["matmul_peak_flops"] > 0
    # Prompts of 32..47 tokens (block size 16) around 40; each row's KV context
    # is measured at the middle of the timed steps (steps waited for one by one,
    # then as many back to back): after the prompt, 2 warm-up steps and steps more.
    one, twenty = result["rows"]
    assert one["context"] == 32 + 2 + steps
    assert twenty["context"] == pytest.approx(sum(40 + i % 16 - 8 for i in range(20)) / 20 + 2 + steps)


def test_kernel_profile_busy_time_is_the_union_of_intervals():
    """The time between kernels is the span less the union of their intervals:
    overlapping kernels (two streams) are not counted twice; the gaps are
    those between the union's pieces."""
    from tandem.bench.kernel_profile import KernelShare, StepProfile, _busy_and_gaps

    assert _busy_and_gaps([]) == (0.0, [])
    assert _busy_and_gaps([(0, 10), (5, 12), (20, 25), (21, 22), (26, 30)]) == (21.0, [8, 1])
    profile = StepProfile(steps=2, kernels=[KernelShare("gemv", 64.0, 900.0), KernelShare("norm", 65.0, 100.0),
                                            KernelShare("copy", 1.0, 10.0)],
                          busy_us_per_step=1000.0, span_us_per_step=1250.0, longest_gap_us_per_step=120.0)
    table = profile.table(top=2)
    assert "gemv" in table and "norm" in table and "(1 other kernels)" in table
    assert "between kernels: 0.250 ms; the longest gap a step: 0.120 ms" in table
    assert "overlap" not in table
    # kernels that start before the one before them ends (dependent launch)
    overlapping = dataclasses.replace(profile, busy_us_per_step=800.0)
    assert "the kernels' times sum to 1.010 ms a step, more than busy: they overlap" in overlapping.table(top=2)


def test_step_gaps_refuse_a_cpu_engine(tmp_path):
    """The GPU's idle time between steps is measured with CUDA events
    (tests/gpu/test_step_gaps_gpu.py); a CPU engine is refused by name."""
    from tandem.bench.step_gaps import measure_step_gaps
    from tandem.engine import LLM
    from tests.support.hf_oracle import tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="CUDA"):
        measure_step_gaps(llm.engine, 2)
    llm.shutdown()


def test_the_floor_reads_an_untied_input_embedding_by_rows_not_whole(tmp_path):
    """A decode step gathers its tokens' rows of the input embedding: an
    untied table counts in no floor; a table that is also the LM head does
    (the head reads all of it)."""
    from transformers import AutoConfig

    from tandem.bench.latency import weight_split
    from tandem.bench.roofline import unread_embedding
    from tandem.engine.models.llama import LlamaFamilyForCausalLM
    from tests.support.hf_oracle import tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "llama")
    config = AutoConfig.from_pretrained(path)
    for tied in (False, True):
        config.tie_word_embeddings = tied
        model = LlamaFamilyForCausalLM(config)
        table = config.vocab_size * config.hidden_size
        all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied table once
        assert unread_embedding(model) == ((0, 0) if tied else (table * 4, table))
        assert weight_split(model)[0] == all_bytes - (0 if tied else table * 4)
