"""`tandem bench mixed-steps` on the CPU: its timed steps carry the prompt
chunk beside the decodes and go through the piecewise graphs when the runner
has them (emulated here); on a CPU engine the command prints eager rows only."""
import itertools
import json
import subprocess
import sys

import pytest
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
        vocab = runner.model.config.vocab_size
        for i in range(3):  # prompts as the command's (run) decodes have, from the same first tokens
            engine.add_request(f"d{i}", [(1000 + 7 * i + j) % vocab for j in range(40)],
                               SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        engine.step()
        engine.scheduler.config.long_prefill_token_threshold = 8
        computed = []
        step = engine.step

        def counting_step():
            out = step()
            prompts = [r for r in engine.scheduler.requests.values() if r.request_id.startswith("p-")]
            computed.append((prompts[0].request_id, prompts[0].num_computed_tokens) if prompts else None)
            return out
        engine.step = counting_step
        timing = time_chunked_steps(engine, 8, 3, "p", itertools.count(1000, 7), lambda: None)
        assert len(timing.steps) == len(timing.forwards) == 3 and len(timing.periods) == 1
        assert timing.replays == 10  # every step, the two warm-up steps of each half too
        # Each half's prompt advances a chunk a step, from its first step on, and is gone after.
        assert [c for c in computed if c is not None] == [
            (f"p-{half}", 8 * k) for half in ("alone", "back-to-back") for k in range(1, 6)]
        assert not any(r.startswith("p-") for r in engine.scheduler.requests)
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


@pytest.mark.parametrize("args, message", [
    # 2 decodes beside a 4-token chunk need a 6-token budget.
    (["--chunks", "4", "--max-num-batched-tokens", "5"], "give --max-num-batched-tokens 6 or more"),
    # 200 timed steps of 16-token chunks need 203 x 16 = 3,248-token prompts; the tiny model has 2,048.
    (["--chunks", "4,16", "--steps", "200"],
     "need prompts of 3248 tokens, past the model's context (2048); give fewer --steps"),
], ids=["past-the-token-budget", "past-the-context"])
def test_settings_the_steps_cannot_carry_are_refused_by_name(tmp_path, args, message):
    path, _ = tiny_model_dir(tmp_path, "llama")
    run = subprocess.run([sys.executable, "-m", "tandem.bench.mixed_steps", "--model", path, "--device", "cpu",
                          "--batch-sizes", "2", *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert message in run.stderr
