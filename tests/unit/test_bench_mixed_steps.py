"""`tandem bench mixed-steps` on the CPU: its timed steps carry the prompt
chunk beside the decodes and go through the piecewise graphs when the runner
has them (emulated here); on a CPU engine the command prints eager rows only."""
import json
import subprocess
import sys

import torch

from tests.support.emulated_graphs import EmulatedPiecewiseGraphs
from tests.support.hf_oracle import tiny_model_dir


def test_each_timed_step_carries_the_chunk_through_the_pieces(tmp_path):
    from tandem.bench.mixed_steps import time_chunked_steps
    from tandem.engine import LLM, SamplingParams

    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=256, max_num_seqs=8)
    try:
        engine, runner = llm.engine, llm.engine.runner
        runner.piecewise = EmulatedPiecewiseGraphs(runner.model, runner.kv_caches, 64, torch.device("cpu"))
        for i in range(3):
            engine.add_request(f"d{i}", [5 + i, 6, 7, 8], SamplingParams(temperature=0, max_tokens=100,
                                                                         ignore_eos=True))
        engine.step()
        engine.scheduler.config.long_prefill_token_threshold = 8
        computed = []
        step = engine.step

        def counting_step():
            out = step()
            prompt = engine.scheduler.requests.get("p")
            computed.append(prompt.num_computed_tokens if prompt is not None else None)
            return out
        engine.step = counting_step
        timing = time_chunked_steps(engine, 8, 3, "p", 1000, lambda: None)
        assert len(timing.steps) == len(timing.forwards) == 3 and len(timing.periods) == 1
        assert timing.replays == 6  # every timed step, alone and back to back
        # The prompt advances a chunk a step, and it is gone after.
        assert [b - a for a, b in zip(computed, computed[1:]) if b is not None] == [8] * (len(computed) - 1)
        assert "p" not in engine.scheduler.requests
    finally:
        llm.shutdown()


def test_the_command_prints_eager_rows_on_a_cpu(tmp_path):
    path, _ = tiny_model_dir(tmp_path, "llama")
    out = tmp_path / "mixed.json"
    run = subprocess.run([sys.executable, "-m", "tandem.bench.mixed_steps", "--model", path, "--device", "cpu",
                          "--batch-sizes", "2", "--chunks", "4,8", "--steps", "2", "--rounds", "1",
                          "--output-json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "eager rows only" in run.stderr
    result = json.loads(out.read_text())
    assert [(r["batch"], r["chunk"], r["tokens_per_step"]) for r in result["rows"]] == [(2, 4, 6), (2, 8, 10)]
    assert all(r["eager"]["step_ms"] > 0 and "piecewise" not in r for r in result["rows"])


def test_a_chunk_past_the_token_budget_is_refused_by_name(tmp_path):
    path, _ = tiny_model_dir(tmp_path, "llama")
    run = subprocess.run([sys.executable, "-m", "tandem.bench.mixed_steps", "--model", path, "--device", "cpu",
                          "--batch-sizes", "2", "--chunks", "4", "--max-num-batched-tokens", "5"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "give --max-num-batched-tokens 6 or more" in run.stderr
