"""tandem's paged KV engine library (see docs/architecture.md)."""
from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine.request import (Request, RequestStatus, SamplingParams, SamplingParamsError,
                                   TokenLogprob)
from tandem.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.llm import LLM, CompletionOutput, GenerateOutput

__all__ = [
    "AsyncLLMEngine", "CacheConfig", "CompletionOutput", "EngineConfig", "EngineStats", "GenerateOutput",
    "LLM", "LLMEngine", "ModelConfig", "Request", "RequestOutput", "RequestStatus", "SamplingParams",
    "SamplingParamsError", "SchedulerConfig", "TokenLogprob",
]
