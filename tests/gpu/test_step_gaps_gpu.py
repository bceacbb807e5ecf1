"""bench/step_gaps.py on the GPU: the device's idle time between engine steps
run back to back, by CUDA events. A host delay before each step must show as
that much more idle time, since a tiny model's step is shorter than it."""
from __future__ import annotations

import time

import pytest
import torch

from tests.support.hf_oracle import tiny_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_host_delay_before_each_step_shows_as_gpu_idle_time(tmp_path):
    from tandem.bench.step_gaps import measure_step_gaps
    from tandem.engine import LLM, SamplingParams

    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, device="cuda", dtype="bfloat16", num_blocks=256)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", [3 + i, 5, 7, 11, 13], params)
    for _ in range(3):
        engine.step()  # prompts, then the decode path warm
    plain = measure_step_gaps(engine, 8)
    delayed = measure_step_gaps(engine, 8, before_step=lambda: time.sleep(0.005))
    assert len(plain.idle_ms) == len(delayed.idle_ms) == 7
    assert all(g >= 0 for g in plain.idle_ms + delayed.idle_ms)
    assert delayed.mean_ms >= plain.mean_ms + 4.0, (plain, delayed)
    assert delayed.max_ms >= delayed.mean_ms
    llm.shutdown()

