"""tandem's paged KV engine library (see docs/architecture.md).

Names are imported on first use (PEP 562): the router needs the request
types, validation and the tokenizer's loader, not the model runner, so
importing `tandem.engine.request` or `tandem.engine.loader` must not load
torch and the model code.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    "CacheConfig": "config", "EngineConfig": "config", "ModelConfig": "config",
    "SchedulerConfig": "config", "EngineArgs": "config", "ConfigError": "config",
    "Request": "request", "RequestFailedError": "request", "RequestStatus": "request",
    "SamplingParams": "request", "SamplingParamsError": "request", "TokenLogprob": "request",
    "EngineStats": "llm_engine", "LLMEngine": "llm_engine", "RequestOutput": "outputs",
    "AsyncLLMEngine": "async_engine", "EngineDeadError": "async_engine",
    "LLM": "llm", "CompletionOutput": "llm", "GenerateOutput": "llm", "BeamSearchOutput": "llm",
    "BeamSearchParams": "beam_search", "BeamSearchParamsError": "beam_search",
    "StructuredOutputs": "structured_outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tandem.engine.{module}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
