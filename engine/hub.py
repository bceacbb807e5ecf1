"""A Hugging Face Hub id (`org/name`) as a local folder, as `vllm serve` does:
huggingface_hub's snapshot_download fetches the files the engine reads into
the Hub cache (or finds them there) and returns the snapshot folder, which the
loader then reads like any HF folder.

The token is huggingface_hub's own business: it reads HF_TOKEN (or the token
`hf auth login` stored). tandem has no token flag, although vLLM has
`--hf-token`: a flag's value shows in `ps`, /proc/<pid>/cmdline and the
command lines `tandem up` writes into its state file and logs, and every
engine child would carry it again. An environment variable (the Helm chart
sets HF_TOKEN from a Secret) leaks nowhere of that.

Offline (HF_HUB_OFFLINE=1, or no network) only the local cache is read;
huggingface_hub falls back to it by itself when the Hub cannot be reached.
Progress of a long download is huggingface_hub's tqdm bars (on stderr;
HF_HUB_DISABLE_PROGRESS_BARS=1 turns them off).

Standard library only at import: the router imports the loader, which imports
this module; huggingface_hub is imported when a Hub id is resolved (it brings
no torch).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

# What the router reads (load_tokenizer): the tokenizer, its chat template,
# and config.json (which marks a folder as a model's).
TOKENIZER_PATTERNS = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
# What an engine reads from a model folder, and nothing else: a repo often
# also holds *.bin / *.pth / *.gguf / *.onnx copies of the same weights that
# would double or triple the download.
ALLOW_PATTERNS = (*TOKENIZER_PATTERNS, "*.safetensors", "*.safetensors.index.json")
# The loader reads the folder's top level only (engine/loader.py globs
# *.safetensors there); fnmatch's `*` also matches `/`, so "*.safetensors"
# alone would fetch e.g. a subfolder's second copy of the weights too.
IGNORE_PATTERNS = ("*/*",)

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_TRUE = {"1", "true", "yes", "on"}


class HubModelNotFound(ValueError):
    """The Hub id cannot be made a local folder: not in the cache while
    offline, not on the Hub, or a revision that does not exist. The message
    names the model and says what to do."""


@dataclass(frozen=True)
class HubSource:
    """Where to find a Hub model: the revision (branch, tag or commit; None:
    main) and the cache folder (None: huggingface_hub's, HF_HUB_CACHE or
    ~/.cache/huggingface/hub)."""

    revision: Optional[str] = None
    cache_dir: Optional[str] = None


def is_hub_id(model: str) -> bool:
    """`org/name` that is not a local path (a local folder wins, as in vLLM)."""
    return bool(_HUB_ID.fullmatch(model)) and not os.path.exists(model)


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now: huggingface_hub
    reads it once at import, which misses a variable set later (a notebook, a
    test); passing local_files_only keeps any network call from happening."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or now.strip().lower() in _TRUE


def cache_dir(source: HubSource) -> str:
    from huggingface_hub import constants

    return os.path.abspath(os.path.expanduser(source.cache_dir or constants.HF_HUB_CACHE))


def snapshot_folder(repo_id: str, source: HubSource = HubSource(),
                    patterns: tuple[str, ...] = ALLOW_PATTERNS) -> str:
    """The local folder of `repo_id` at `source.revision` holding the files
    `patterns` match: downloaded or found in the cache. Raises HubModelNotFound."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    revision = source.revision or "main"
    is_offline = offline()
    try:
        return snapshot_download(repo_id, revision=source.revision, cache_dir=source.cache_dir,
                                 allow_patterns=list(patterns),
                                 ignore_patterns=list(IGNORE_PATTERNS),
                                 local_files_only=is_offline)
    except GatedRepoError as exc:  # a RepositoryNotFoundError: check it first
        raise HubModelNotFound(
            f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms on "
            f"huggingface.co/{repo_id} and set HF_TOKEN to a token of that account ({exc})") from exc
    except RepositoryNotFoundError as exc:
        raise HubModelNotFound(
            f"model {repo_id!r} is not on the Hugging Face Hub (or is private: set HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise HubModelNotFound(
            f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub") from exc
    except LocalEntryNotFoundError as exc:
        # IncompleteSnapshotError (a subclass): the commit's listing names files
        # the snapshot lacks (a download cut short, or one of fewer patterns).
        held = ("is only partly" if isinstance(exc, IncompleteSnapshotError) else "is not")
        why = ("HF_HUB_OFFLINE is set" if is_offline
               else f"the Hub cannot be reached ({type(exc.__cause__ or exc).__name__})")
        where = cache_dir(source)
        fill = f"hf download {repo_id}" + (f" --revision {source.revision}" if source.revision else "")
        fill += f" --cache-dir {where}"
        raise HubModelNotFound(
            f"model {repo_id!r} (revision {revision}) {held} in the Hugging Face cache {where} and "
            f"{why}: fill the cache where the Hub can be reached (`{fill}`, or run tandem there once "
            f"with the same --download-dir), or give a local model folder") from exc
