"""A GGUF file converted once into a HF folder (config.json, tokenizer files,
model.safetensors) under the user's cache directory.

Reading a GGUF through transformers parses the whole file for the config,
again for the tokenizer, and de-quantizes every tensor: about 35 s on a
2-core CPU, paid by each process of the stack (router, prefill, decode) at
every start. The converted folder loads in a few seconds. The cache key is the
file's real path, size and modification time, so a changed file is converted
again; a cache that cannot be written (read-only home) only costs the slow
path, never a failure.

TANDEM_CACHE_DIR moves the cache (default: $XDG_CACHE_HOME/tandem or
~/.cache/tandem); TANDEM_GGUF_CACHE=0 turns it off.
"""
from __future__ import annotations

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

    Several processes may build it at once (the stack starts them together):
    each writes a private temporary folder and renames it into place; the
    first rename wins and the others discard theirs.
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
        tmp = tempfile.mkdtemp(prefix=".building-", dir=parent)
    except OSError as exc:
        log.warning("cannot write the model cache under %s (%s); reading the GGUF file directly", parent, exc)
        return None
    try:
        log.info("converting %s into %s (once; later starts load the folder)", gguf_path, folder)
        _write_folder(tmp, read_config(), read_tokenizer(), read_state())
        open(os.path.join(tmp, COMPLETE_MARKER), "w").close()
        try:
            os.rename(tmp, folder)
        except OSError:
            if not os.path.exists(os.path.join(folder, COMPLETE_MARKER)):
                raise
            # another process finished first; its folder is as good as ours
    except OSError as exc:
        log.warning("cannot write the model cache %s (%s); reading the GGUF file directly", folder, exc)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
