"""A real Hugging Face Hub cache on disk, built from local files without any
network: the layout huggingface_hub documents and reads
(https://huggingface.co/docs/huggingface_hub/guides/manage-cache):

    <cache>/models--<org>--<name>/
        blobs/<etag>                     each file's bytes, once
        snapshots/<commit>/<path>        relative symlinks into blobs/
        refs/<branch or tag>             the commit it points at
        trees/<commit>.json              the commit's file listing (huggingface_hub >= 2.x)

The etag is what the Hub reports: the git blob sha1 of a regular file, the
sha256 of an LFS file (weights). The listing is written with huggingface_hub's
own write_tree_cache: with it, an offline snapshot_download checks that every
file its patterns ask for is in the snapshot (IncompleteSnapshotError
otherwise), which is how the tests see what tandem's allow-patterns ask for.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Optional

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pth", ".pt", ".onnx", ".model")


@dataclass
class HubCache:
    root: str  # the cache folder (HF_HUB_CACHE, --download-dir)
    commits: dict[str, str] = field(default_factory=dict)  # revision name -> commit

    def repo_folder(self, repo_id: str) -> str:
        return os.path.join(self.root, "models--" + repo_id.replace("/", "--"))

    def add_commit(self, repo_id: str, files: dict[str, bytes], *, refs: tuple[str, ...] = ("main",),
                   commit: Optional[str] = None, listed_only: tuple[str, ...] = ()) -> str:
        """Put one commit of `repo_id` holding `files` (repo path -> bytes)
        into the cache, point `refs` at it, and return its commit hash.
        listed_only: paths the commit has on the Hub (in its listing) that were
        not downloaded, as a download with allow-patterns leaves them."""
        commit = commit or hashlib.sha1(repr(sorted((p, hashlib.sha256(b).hexdigest())
                                                    for p, b in files.items())).encode()).hexdigest()
        repo = self.repo_folder(repo_id)
        snapshot = os.path.join(repo, "snapshots", commit)
        entries = {}
        for path, data in files.items():
            etag, entry = _etag_and_entry(path, data)
            entries[path] = entry
            blob = os.path.join(repo, "blobs", etag)
            os.makedirs(os.path.dirname(blob), exist_ok=True)
            with open(blob, "wb") as f:
                f.write(data)
            link = os.path.join(snapshot, path)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
        for path in listed_only:
            entries[path] = _etag_and_entry(path, path.encode())[1]
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        for ref in refs:
            with open(os.path.join(repo, "refs", ref), "w") as f:
                f.write(commit)  # no newline, as huggingface_hub writes it
            self.commits[ref] = commit
        from huggingface_hub._tree_cache import write_tree_cache  # the real writer of trees/<commit>.json

        write_tree_cache(repo, commit, entries)
        return commit


def _etag_and_entry(path: str, data: bytes):
    from huggingface_hub._tree_cache import TreeCacheEntry

    git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    if path.endswith(LFS_SUFFIXES):
        sha256 = hashlib.sha256(data).hexdigest()
        return sha256, TreeCacheEntry(size=len(data), blob_id=git_sha1, lfs_sha256=sha256,
                                      lfs_size=len(data))
    return git_sha1, TreeCacheEntry(size=len(data), blob_id=git_sha1)


def folder_files(folder: str) -> dict[str, bytes]:
    """Every file under `folder` (a saved HF model), by its path inside it."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, folder).replace(os.sep, "/")] = f.read()
    return out
