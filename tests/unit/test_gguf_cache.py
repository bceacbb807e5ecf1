"""The embedded GGUF converted once into a HF folder: what the engine loads from
the folder must be what transformers reads from the GGUF file itself."""
from __future__ import annotations

import os

import pytest
import torch

from tandem.engine import gguf_cache, loader


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TANDEM_GGUF_CACHE", raising=False)
    loader._gguf_as_folder.cache_clear()
    yield tmp_path / "cache"
    loader._gguf_as_folder.cache_clear()


def test_folder_holds_the_same_config_tokenizer_and_weights(fresh_cache):
    path = loader.embedded_gguf_path()
    info = loader.load_model_info("smollm2")
    folder = gguf_cache.cache_folder(path)
    assert folder.startswith(str(fresh_cache))
    assert os.path.exists(os.path.join(folder, gguf_cache.COMPLETE_MARKER))
    assert info.model_id == loader.EMBEDDED_MODEL_ID

    direct = loader._hf_config("gguf", path)
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta",
                  "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(info.hf_config, field, None) == getattr(direct, field, None), field

    tok = loader._tokenizer("gguf", path)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France? Ünïcödé, emoji 🙂"}]
    assert (info.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    for text in ("The capital of France is", "  spaces\tand\nnewlines", "日本語のテキスト"):
        assert info.tokenizer(text)["input_ids"] == tok(text)["input_ids"]
    assert info.tokenizer.eos_token_id == tok.eos_token_id

    from safetensors.torch import load_file

    converted = load_file(os.path.join(folder, "model.safetensors"))
    original = loader.gguf_state_dict(path)
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name


def test_second_load_reuses_the_folder(fresh_cache):
    path = loader.embedded_gguf_path()
    loader.load_model_info("smollm2")
    folder = gguf_cache.cache_folder(path)
    stamp = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    loader._gguf_as_folder.cache_clear()
    loader.load_model_info("smollm2")
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == stamp
    assert [p for p in os.listdir(os.path.dirname(folder)) if p.startswith(".building-")] == []


def test_unwritable_cache_falls_back_to_the_gguf_file(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker / "cache"))  # cannot be created, even as root
    loader._gguf_as_folder.cache_clear()
    try:
        info = loader.load_model_info("smollm2")
        assert loader._gguf_as_folder(loader.embedded_gguf_path()) is None
        assert info.tokenizer("Paris")["input_ids"]
        assert info.hf_config.num_hidden_layers == 30
    finally:
        loader._gguf_as_folder.cache_clear()


def test_cache_can_be_turned_off(fresh_cache, monkeypatch):
    monkeypatch.setenv("TANDEM_GGUF_CACHE", "0")
    loader.load_model_info("smollm2")
    assert not os.path.exists(fresh_cache)


def test_a_changed_file_gets_a_new_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x")
    before = gguf_cache.cache_folder(str(f))
    os.utime(f, ns=(0, 1_000_000_000))
    assert gguf_cache.cache_folder(str(f)) != before


class _FakeConfig:
    def save_pretrained(self, folder: str) -> None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write("{}")


def _convert_counting(gguf_path: str, cache_dir: str, log_path: str, results) -> None:
    """One process of the stack asking for the folder; its conversion takes a
    second and leaves a line in log_path."""
    import time

    os.environ["TANDEM_CACHE_DIR"] = cache_dir

    def read_state() -> dict:
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        return {"w": torch.zeros(2)}

    results.put(gguf_cache.cached_hf_folder(gguf_path, _FakeConfig, lambda: None, read_state))


def test_processes_asking_at_once_convert_once(tmp_path):
    import multiprocessing

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x")
    log_path = tmp_path / "conversions"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_convert_counting, args=(str(gguf), str(tmp_path / "cache"), str(log_path), results))
             for _ in range(2)]
    for p in procs:
        p.start()
    folders = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len(log_path.read_text().split()) == 1, "each process converted the file"
    assert folders[0] is not None and len(set(folders)) == 1
    assert os.path.exists(os.path.join(folders[0], gguf_cache.COMPLETE_MARKER))


def test_gguf_parsed_once_shares_the_reader_and_the_name_map(tmp_path):
    """Inside gguf_parsed_once, what transformers asks gguf for twice is made
    once: the file's reader and the tensor-name map (each cost seconds per
    request); outside, gguf is as it was."""
    import gguf

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 2).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real_reader = gguf.GGUFReader
    with loader.gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first
        assert first.get_tensor(0).name == "token_embd.weight"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is real_reader
    assert gguf.GGUFReader(path) is not first
