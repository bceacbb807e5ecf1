"""A GGUF file converted once into a HF folder (config.json, tokenizer files,
model.safetensors) under the user's cache directory.

Reading a GGUF through transformers parses the file and de-quantizes every
tensor: about 15 s of a core on dev even when the file is parsed once
(loader.gguf_parsed_once; 40 s before), which every process of the stack
would pay at every start. The converted folder loads in a few seconds. The
cache key is the file's real path, size and modification time, so a changed
file is converted again; a cache that cannot be written (read-only home)
only costs the slow path, never a failure.

TANDEM_CACHE_DIR moves the cache (default: $XDG_CACHE_HOME/tandem or
~/.cache/tandem); TANDEM_GGUF_CACHE=0 turns it off.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:  # only named in annotations; the router reads the cached folder without torch
    import torch

log = logging.getLogger(__name__)

# Bump when what goes into the folder changes, so old folders are not reused.
FORMAT_VERSION = 1
COMPLETE_MARKER = ".complete"


def cache_root() -> str:
    explicit = os.environ.get("TANDEM_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tandem")


def enabled() -> bool:
    return os.environ.get("TANDEM_GGUF_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_folder(gguf_path: str) -> str:
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}:{st.st_size}:{st.st_mtime_ns}:{FORMAT_VERSION}".encode()).hexdigest()[:16]
    name = os.path.basename(real)[: -len(".gguf")] if real.endswith(".gguf") else os.path.basename(real)
    return os.path.join(cache_root(), "gguf", f"{name}-{key}")


def _write_folder(folder: str, config: Any, tokenizer: Any, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    # safetensors refuses tensors that share storage or are views: give each its own.
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()},
              os.path.join(folder, "model.safetensors"))


def existing_folder(gguf_path: str) -> Optional[str]:
    """The converted folder for `gguf_path` if one is complete, without
    building it (building de-quantizes the weights, which needs torch)."""
    if not enabled():
        return None
    try:
        folder = cache_folder(gguf_path)
    except OSError:
        return None
    return folder if os.path.exists(os.path.join(folder, COMPLETE_MARKER)) else None


def cached_hf_folder(gguf_path: str, read_config: Callable[[], Any], read_tokenizer: Callable[[], Any],
                     read_state: Callable[[], dict[str, torch.Tensor]]) -> Optional[str]:
    """The converted folder for `gguf_path`, building it on first use; None when
    the cache is off or cannot be written (the caller reads the GGUF itself).

    Several processes ask at once (the stack starts them together): one
    builds, holding a lock on FOLDER.lock, and the others wait for it and
    load its folder; a conversion is half a minute of a core, and each of
    them doing its own costs every core but one for nothing.
    The builder writes a private temporary folder and renames it into place,
    so a builder that dies leaves nothing half-written (and its lock goes
    with it).
    """
    if not enabled():
        return None
    try:
        folder = cache_folder(gguf_path)
    except OSError:
        return None
    if os.path.exists(os.path.join(folder, COMPLETE_MARKER)):
        return folder
    parent = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        lock = open(folder + ".lock", "w")
    except OSError as exc:
        log.warning("cannot write the model cache under %s (%s); reading the GGUF file directly", parent, exc)
        return None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process converting %s into %s", gguf_path, folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(folder, COMPLETE_MARKER)):
            return folder
        return _build(gguf_path, folder, read_config, read_tokenizer, read_state)


def _build(gguf_path: str, folder: str, read_config: Callable[[], Any], read_tokenizer: Callable[[], Any],
           read_state: Callable[[], dict[str, torch.Tensor]]) -> Optional[str]:
    try:
        tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(folder))
    except OSError as exc:
        log.warning("cannot write the model cache %s (%s); reading the GGUF file directly", folder, exc)
        return None
    try:
        log.info("converting %s into %s (once; later starts load the folder)", gguf_path, folder)
        _write_folder(tmp, read_config(), read_tokenizer(), read_state())
        open(os.path.join(tmp, COMPLETE_MARKER), "w").close()
        os.rename(tmp, folder)
    except OSError as exc:
        log.warning("cannot write the model cache %s (%s); reading the GGUF file directly", folder, exc)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
