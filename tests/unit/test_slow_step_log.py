"""A step slow enough to show in token latencies is logged with where its
host time went, at most once per SLOW_STEP_LOG_S."""
from __future__ import annotations

import logging

from tandem.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams
from tandem.engine import llm_engine
from tandem.engine.llm_engine import LLMEngine
from tests.support.hf_oracle import tiny_model_dir


def test_a_slow_step_is_logged_with_its_phases_once_per_period(tmp_path, caplog, monkeypatch):
    path, _ = tiny_model_dir(tmp_path, "llama")
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                                    cache=CacheConfig(block_size=16, num_blocks=64), device="cpu"))
    monkeypatch.setattr(llm_engine, "SLOW_STEP_S", 0.0)  # every step counts as slow here
    engine.add_request("r", list(range(5, 40)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    with caplog.at_level(logging.WARNING, logger=llm_engine.__name__):
        while engine.has_unfinished():
            engine.step()
    lines = [r.message for r in caplog.records if r.message.startswith("a step took")]
    assert len(lines) == 1  # four steps, one period
    assert "forward" in lines[0] and "KV loads" in lines[0]
