"""`--model org/name` resolves through huggingface_hub (engine/hub.py), as
`vllm serve` does, here without any network: a real Hub cache built on disk
(tests/support/hub_cache.py) and HF_HUB_OFFLINE, so huggingface_hub reads the
cache only. A tiny random-weight Llama saved as safetensors, with the
SmolLM2 tokenizer, is the repo `org/tiny`: main and a second commit `v2`
with other weights."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.engine import LLM, SamplingParams
from tandem.engine.hub import ALLOW_PATTERNS, IGNORE_PATTERNS, HubSource, snapshot_folder
from tandem.engine.loader import ModelNotFoundError, load_model_info, resolve_source
from tests.support.hf_oracle import tiny_model_dir
from tests.support.hub_cache import HubCache, folder_files

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 17, 300, 42], [7, 7, 7]]  # ids below the tiny model's vocabulary (512)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may reach the network: engine/hub.py reads HF_HUB_OFFLINE
    when it resolves (huggingface_hub itself read it at import, before this)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """(cache, {revision: the local folder of that commit})."""
    tmp = tmp_path_factory.mktemp("hub")
    tokenizer = load_model_info("smollm2").tokenizer
    folders = {}
    cache = HubCache(str(tmp / "cache"))
    for revision, seed in (("main", 0), ("v2", 1)):
        folder, _ = tiny_model_dir(tmp / revision, "llama", seed=seed)
        tokenizer.save_pretrained(folder)
        folders[revision] = folder
        cache.add_commit("org/tiny", folder_files(folder), refs=(revision,))
    return cache, folders


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def engine(model: str, **kwargs) -> LLM:
    return LLM(model, device="cpu", num_blocks=32, **kwargs)


def test_the_cache_is_one_huggingface_hub_reads(repo):
    """The hand-built layout is what huggingface_hub's own cache scanner sees."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    cache, _ = repo
    (info,) = scan_cache_dir(cache.root).repos
    assert (info.repo_id, info.repo_type, len(info.revisions)) == ("org/tiny", "model", 2)
    assert {ref for r in info.revisions for ref in r.refs} == {"main", "v2"}
    assert try_to_load_from_cache("org/tiny", "config.json", cache_dir=cache.root, revision="v2")


def test_a_hub_id_generates_what_its_folder_generates(repo):
    cache, folders = repo
    hub = engine("org/tiny", download_dir=cache.root)
    assert hub.engine.model_id == "org/tiny"  # served under the id it was started with
    assert greedy(hub) == greedy(engine(folders["main"]))
    # The tokenizer comes from the snapshot too.
    assert hub.engine.tokenizer.encode("Once upon a time") == load_model_info(
        "smollm2").tokenizer.encode("Once upon a time")


def test_revision_picks_the_other_snapshot(repo):
    cache, folders = repo
    main = greedy(engine("org/tiny", download_dir=cache.root))
    v2 = greedy(engine("org/tiny", download_dir=cache.root, revision="v2"))
    assert v2 == greedy(engine(folders["v2"])) and v2 != main
    by_commit = resolve_source("org/tiny", hub_source=HubSource(cache.commits["v2"], cache.root))
    assert by_commit.path.endswith(os.path.join("snapshots", cache.commits["v2"]))


def test_a_model_missing_from_the_cache_offline_names_it_and_how_to_fill_the_cache(repo, tmp_path):
    cache, _ = repo
    with pytest.raises(ModelNotFoundError) as missing:
        resolve_source("org/absent", hub_source=HubSource(cache_dir=cache.root))
    text = str(missing.value)
    assert text.startswith(f"model 'org/absent' (revision main) is not in the Hugging Face cache "
                           f"{cache.root} and HF_HUB_OFFLINE is set")
    assert f"`hf download org/absent --cache-dir {cache.root}`" in text
    with pytest.raises(ModelNotFoundError, match=r"'org/tiny' \(revision v9\) is not in the Hugging Face cache"):
        resolve_source("org/tiny", hub_source=HubSource("v9", cache.root))


def test_the_allow_patterns_ask_only_for_what_the_engine_reads(repo, tmp_path):
    """A repo that also holds .bin, .gguf, .pth and subfolder copies of its
    weights: tandem's patterns ask for none of them. huggingface_hub checks an
    offline snapshot against the commit's listing, so the snapshot that holds
    only the engine's files is complete for tandem's patterns and incomplete
    for a download of everything."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError

    _, folders = repo
    cache = HubCache(str(tmp_path / "cache"))
    extra = ("pytorch_model.bin", "model.gguf", "original/consolidated.00.pth",
             "onnx/model.safetensors", "README.md", ".gitattributes")
    cache.add_commit("org/many", folder_files(folders["main"]), listed_only=extra)
    folder = snapshot_folder("org/many", HubSource(cache_dir=cache.root))
    assert sorted(os.listdir(folder)) == sorted(folder_files(folders["main"]))
    with pytest.raises(IncompleteSnapshotError, match="pytorch_model.bin"):
        snapshot_download("org/many", cache_dir=cache.root, local_files_only=True)

    from huggingface_hub.utils import filter_repo_objects

    kept = set(filter_repo_objects(
        [*folder_files(folders["main"]), *extra, "model-00001-of-00002.safetensors",
         "model.safetensors.index.json", "tokenizer.model", "merges.txt", "vocab.json"],
        allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS)))
    assert kept.isdisjoint(extra)
    assert {"model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.model",
            "merges.txt", "vocab.json", "config.json", "tokenizer.json"} <= kept


def test_the_router_loads_a_hub_tokenizer_from_the_env_without_torch(repo):
    """The router's view (load_tokenizer) with only huggingface_hub's own
    variables, read at its import: HF_HUB_OFFLINE and HF_HUB_CACHE."""
    cache, _ = repo
    code = ("import sys; from tandem.engine.loader import load_tokenizer; "
            "t = load_tokenizer('org/tiny'); "
            "print(t.model_id, t.tokenizer.encode('Once upon a time'), 'torch' in sys.modules)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache.root)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    ids = load_model_info("smollm2").tokenizer.encode("Once upon a time")
    assert done.stdout.split("\n")[0] == f"org/tiny {ids} False"


def test_the_router_asks_for_the_tokenizer_files_only(repo, tmp_path):
    """A snapshot that holds only what a tokenizer-only download fetches (the
    commit lists its weights too): enough for the router's view, and an
    engine on it is told the snapshot is incomplete."""
    from tandem.engine.hub import TOKENIZER_PATTERNS
    from tandem.engine.loader import load_tokenizer

    _, folders = repo
    files = folder_files(folders["main"])
    assert "model.safetensors" in files and "model.safetensors" not in TOKENIZER_PATTERNS
    cache = HubCache(str(tmp_path / "cache"))
    cache.add_commit("org/tok", {p: b for p, b in files.items() if p != "model.safetensors"},
                     listed_only=("model.safetensors",))
    source = HubSource(cache_dir=cache.root)
    assert load_tokenizer("org/tok", hub_source=source).model_id == "org/tok"
    with pytest.raises(ModelNotFoundError, match=r"'org/tok' \(revision main\) is only partly in the Hugging Face cache"):
        resolve_source("org/tok", hub_source=source)
