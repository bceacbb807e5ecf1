"""Engine configuration: plain dataclasses whose fields are the knobs vLLM users know."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

SchedulingPolicy = Literal["fifo", "srtf"]
# Token budget of a step by device: a GPU step of 8192 tokens takes tens of
# ms; on a CPU 2048 tokens already take seconds, and the budget is how long an
# aborted prompt may keep computing.
DEFAULT_TOKEN_BUDGET = {"cuda": 8192, "cpu": 2048}
LoadFormat = Literal["auto", "gguf", "safetensors", "dummy"]
KVRole = Literal["producer", "consumer", "both"]
# How KV moves between engines: through the KV store service (a KVStore the
# caller injects), or copied straight from a prefill's shared memory on one host.
KVTransfer = Literal["store", "direct"]


@dataclass
class ModelConfig:
    # A model id, a HF folder (config.json + safetensors), a .gguf file, or
    # "smollm2" / "HuggingFaceTB/SmolLM2-135M-Instruct" for the embedded model.
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    load_format: LoadFormat = "auto"
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    max_model_len: Optional[int] = None  # None: the model's own limit
    seed: int = 0  # seeds dummy weights
    # A transformers PretrainedConfig, when the caller already has one (tests,
    # dummy weights); otherwise read from `model`.
    hf_config: Optional[object] = None
    tokenizer: Optional[str] = None  # a HF folder, a .gguf file or "smollm2"; None: `model`'s own


@dataclass
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks. None: sized from free memory (CUDA, see
    # gpu_memory_utilization) or from cpu_kv_cache_gib on the CPU.
    num_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    # The token budget of one step; None: DEFAULT_TOKEN_BUDGET for the device.
    # It bounds a step's time and memory: an abort or a disconnect takes
    # effect between steps, so a prompt's compute stops within one chunk.
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: int = 256
    policy: SchedulingPolicy = "fifo"
    staging_queue_size: int = 8  # two-level SRTF (thesis 4.5.3)
    # Prefill chunks are at most this long (0: only the token budget limits them).
    long_prefill_token_threshold: int = 0


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # "auto": cuda when available, else cpu
    enforce_eager: bool = False  # True: no CUDA graphs
    # Where KV goes besides the local cache: None for a colocated engine.
    # "store" needs a KVStore passed to LLMEngine (services pass their client).
    kv_transfer: Optional[KVTransfer] = None
    kv_role: KVRole = "both"
    # Direct transfer: seconds a prefill keeps a finished prompt's blocks for
    # the decode to copy when nobody releases them earlier.
    kv_hold_timeout_s: float = 30.0

    def with_defaults(self) -> "EngineConfig":
        """A copy with every device-dependent default (None) decided."""
        if self.scheduler.max_num_batched_tokens is not None:
            return self
        budget = DEFAULT_TOKEN_BUDGET[self.resolved_device()]
        return dataclasses.replace(self, scheduler=dataclasses.replace(
            self.scheduler, max_num_batched_tokens=budget))

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
