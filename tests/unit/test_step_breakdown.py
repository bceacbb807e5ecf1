"""`bench throughput --step-breakdown` (bench/step_breakdown.py): each
interval between two engine.step() returns goes to the step that call waited
for, named by the path ModelRunner.forward took; the paths' times add up to
the run and their tokens to the tokens the forwards carried."""
import json
import subprocess
import sys

import torch

from tandem.bench.step_breakdown import NO_STEP, StepCall, StepRecorder, attribute
from tests.support.emulated_graphs import EmulatedGraphs, EmulatedPiecewiseGraphs
from tests.support.hf_oracle import tiny_model_dir

CALLS = [StepCall(1.0, ("eager", 10)), StepCall(3.0, ("decode graphs", 4)), StepCall(4.0, None)]


def test_a_call_waits_for_its_own_step_or_under_asynchronous_scheduling_the_one_before():
    step_by_step = attribute(CALLS, 0.0, asynchronous=False)
    assert step_by_step["eager"] == [10, 1.0, 1]
    assert step_by_step["decode graphs"] == [4, 2.0, 1]
    assert step_by_step[NO_STEP] == [0, 1.0, 0]
    overlapped = attribute(CALLS, 0.0, asynchronous=True)
    assert overlapped[NO_STEP] == [0, 1.0, 0]  # the first call waited for nothing
    assert overlapped["eager"] == [10, 2.0, 1]
    assert overlapped["decode graphs"] == [4, 1.0, 1]


def test_the_recorder_names_each_steps_path(tmp_path):
    from tandem.engine import LLM, SamplingParams

    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    try:
        runner = llm.engine.runner
        cpu = torch.device("cpu")
        runner.graphs = EmulatedGraphs(runner.model, runner.kv_caches, 8, 512, runner.block_size, cpu)
        runner.piecewise = EmulatedPiecewiseGraphs(runner.model, runner.kv_caches, 64, cpu)
        prompts = [[5 + i] * 100 for i in range(3)]  # 300 prompt tokens: chunks under the 64-token budget
        with StepRecorder(llm.engine) as recorder:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        paths = [c.launched[0] for c in recorder.calls if c.launched is not None]
        assert set(paths) == {"piecewise graphs", "decode graphs"}
        assert paths[0] == "piecewise graphs" and paths[-1] == "decode graphs"
        assert sum(c.launched[1] for c in recorder.calls if c.launched) == 300 + 3 * 5
        assert "step" not in vars(llm.engine) and "forward" not in vars(runner)  # unwrapped after
    finally:
        llm.shutdown()


def test_the_command_reports_the_first_pass_by_path(tmp_path):
    # The embedded SmolLM2 (the bench draws prompt ids from a real vocabulary's range).
    out = tmp_path / "throughput.json"
    run = subprocess.run([sys.executable, "-m", "tandem.bench.throughput", "--device", "cpu",
                          "--num-prompts", "6", "--input-len", "20", "60", "--output-len", "8", "--no-hf",
                          "--step-breakdown", "--output-json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "by the path of its steps" in run.stdout
    result = json.loads(out.read_text())
    first = result["results"][0]
    rows = {r["path"]: r for r in result["step_breakdown"]}
    assert set(rows) <= {"eager", NO_STEP}  # no graphs on a CPU
    # Every prompt token and every output token but each answer's last went through a forward.
    assert rows["eager"]["tokens"] == first["input_tokens"] + first["output_tokens"] - 6
    seconds = sum(r["seconds"] for r in rows.values())
    assert 0.9 * first["seconds"] <= seconds <= first["seconds"]
