"""A step slow enough to show in token latencies is logged with where its
host time went, at most once per SLOW_STEP_LOG_S."""
from __future__ import annotations

import logging

import pytest

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


def test_a_slow_step_names_the_triton_kernels_it_compiled(tmp_path, caplog, monkeypatch):
    """A kernel compiled inside a step (as Triton reports it through its
    post-compile hook; no compile happens on this CPU, so the model's forward
    reports one) is named in that step's line."""
    import types

    import triton

    from tandem.kernels import compile_log

    if not compile_log.install():
        pytest.skip("this Triton has no post-compile hook")
    path, _ = tiny_model_dir(tmp_path, "llama")
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                                    cache=CacheConfig(block_size=16, num_blocks=64), device="cpu"))
    monkeypatch.setattr(llm_engine, "SLOW_STEP_S", 0.0)
    model = engine.runner.model
    forward = model.forward

    def forward_that_compiles(*args, **kwargs):
        triton.knobs.runtime.jit_post_compile_hook(fn=types.SimpleNamespace(name="_decode_reduce_kernel"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward_that_compiles)
    before = compile_log.compiles()
    engine.add_request("r", list(range(5, 40)), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    with caplog.at_level(logging.WARNING, logger=llm_engine.__name__):
        while engine.has_unfinished():
            engine.step()
    assert compile_log.compiles() == before + 1
    lines = [r.message for r in caplog.records if r.message.startswith("a step took")]
    assert lines and lines[0].endswith("; compiled Triton kernels _decode_reduce_kernel")
