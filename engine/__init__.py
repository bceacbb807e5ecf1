"""tandem's paged KV engine library (see docs/architecture.md)."""
from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine.request import (Request, RequestFailedError, RequestStatus, SamplingParams,
                                   SamplingParamsError, TokenLogprob)
from tandem.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from tandem.engine.async_engine import AsyncLLMEngine, EngineDeadError
from tandem.engine.llm import LLM, CompletionOutput, GenerateOutput

__all__ = [
    "AsyncLLMEngine", "CacheConfig", "CompletionOutput", "EngineConfig", "EngineDeadError", "EngineStats",
    "GenerateOutput", "LLM", "LLMEngine", "ModelConfig", "Request", "RequestFailedError", "RequestOutput",
    "RequestStatus", "SamplingParams",
    "SamplingParamsError", "SchedulerConfig", "TokenLogprob",
]
