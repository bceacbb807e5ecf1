"""EngineArgs: every engine setting declared once, as a flag with its TANDEM_
env twin, help and choices, for the roles, `tandem up`, `tandem generate`,
the benchmarks and `LLM(**kwargs)` alike."""
from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

import pytest

from tandem.engine.config import DEFAULT_MODEL, ConfigError, EngineArgs
from tandem.engine.flags import flag_specs

REPO = pathlib.Path(__file__).resolve().parents[2]


def parse(*argv: str, skip: tuple[str, ...] = ()) -> EngineArgs:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, skip=skip)
    return EngineArgs.from_cli_args(p.parse_args(list(argv)))


@pytest.fixture(autouse=True)
def no_tandem_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("TANDEM_"):
            monkeypatch.delenv(key)


def test_every_engine_flag_is_in_the_roles_help_with_its_env_twin():
    from tandem.services.prefill.server import add_arguments

    p = argparse.ArgumentParser(prog="tandem serve prefill")
    add_arguments(p)
    text = " ".join(p.format_help().split())  # unwrapped
    for spec in flag_specs(EngineArgs):
        assert spec.flag in text and f"[env {spec.env}]" in text, spec.flag
        if spec.default is not None and spec.type is not bool:
            assert f"(default: {spec.default}) [env {spec.env}]" in text, spec.flag


def test_fields_that_are_no_flags_stay_out_of_the_parser():
    assert {"hf_config", "kv_role", "seed"}.isdisjoint(EngineArgs.cli_fields())
    assert {"model", "kv_transfer", "kv_store", "attention_backend"} <= set(EngineArgs.cli_fields())


def test_command_line_beats_env_beats_default(monkeypatch):
    assert parse().block_size == 16
    monkeypatch.setenv("TANDEM_BLOCK_SIZE", "32")
    assert parse().block_size == 32
    assert parse("--block-size", "8").block_size == 8


@pytest.mark.parametrize("text, value", [("1", True), ("yes", True), ("On", True), ("false", False),
                                         ("0", False), ("off", False)])
def test_switch_twins_take_the_usual_words(monkeypatch, text, value):
    monkeypatch.setenv("TANDEM_ENFORCE_EAGER", text)
    assert parse().enforce_eager is value


def test_a_negated_switch_and_its_twin_turn_the_prefix_cache_off(monkeypatch):
    assert parse().enable_prefix_caching is True
    assert parse("--no-prefix-caching").enable_prefix_caching is False
    monkeypatch.setenv("TANDEM_NO_PREFIX_CACHING", "1")
    assert parse().create_engine_config().cache.enable_prefix_caching is False


@pytest.mark.parametrize("env, value, expected", [
    ("TANDEM_NUM_BLOCKS", "many", "error: TANDEM_NUM_BLOCKS='many' is not valid for --num-blocks"),
    ("TANDEM_ENFORCE_EAGER", "maybe", "error: TANDEM_ENFORCE_EAGER='maybe' is not valid for --enforce-eager"),
    ("TANDEM_POLICY", "lifo", "error: TANDEM_POLICY='lifo' is not valid for --policy: choose from fifo, srtf"),
])
def test_a_bad_env_value_is_an_error_naming_the_variable(monkeypatch, capsys, env, value, expected):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as exit_:
        parse()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(expected)


def test_choices_come_from_the_annotation():
    specs = {s.name: s for s in flag_specs(EngineArgs)}
    assert specs["kv_transfer"].choices == ("none", "store", "direct", "nixl")
    assert specs["attention_backend"].choices == ("auto", "triton", "torch")
    with pytest.raises(SystemExit):
        parse("--policy", "lifo")


def test_to_cli_args_reproduces_every_non_default_value():
    given = parse("--model", "/m", "--block-size", "32", "--no-prefix-caching", "--enforce-eager",
                  "--no-piecewise-cuda-graphs",
                  "--kv-transfer", "store", "--kv-store", "h:1", "--gpu-memory-utilization", "0.45",
                  "--attention-backend", "torch")
    argv = given.to_cli_args()
    assert parse(*argv) == given
    assert given.create_engine_config().piecewise_cuda_graphs is False
    assert "--max-num-seqs" not in argv and "--policy" not in argv  # defaults stay implicit
    assert parse().to_cli_args() == []


def test_kv_store_is_needed_with_store_and_refused_without():
    with pytest.raises(ConfigError, match="--kv-transfer store needs --kv-store HOST:PORT"):
        parse("--kv-transfer", "store").create_engine_config()
    with pytest.raises(ConfigError, match="--kv-store is set but --kv-transfer is none"):
        parse("--kv-store", "h:1").create_engine_config()
    assert parse("--kv-transfer", "store", "--kv-store", "h:1").create_engine_config().kv_transfer == "store"
    assert parse("--kv-transfer", "direct").create_engine_config().kv_transfer == "direct"
    assert parse().create_engine_config().kv_transfer is None
    # The Python API hands the engine its KVStore object: no address.
    assert EngineArgs(kv_transfer="store").create_engine_config(kv_store_injected=True).kv_transfer == "store"


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "--block-size: must be above 0, got 0"),
    ({"block_size": "16"}, "--block-size: expected an integer, got '16'"),
    ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization: a share of the GPU"),
    ({"dtype": "bf16"}, "--dtype: 'bf16' is not one of auto, float32, float16, bfloat16"),
    ({"long_prefill_token_threshold": -1}, "--long-prefill-token-threshold: must be 0"),
    ({"attention_backend": "triton", "device": "cpu"}, "--attention-backend triton needs CUDA"),
    ({"kv_staging_gib": 0}, "--kv-staging-gib: must be above 0, got 0"),
])
def test_a_bad_setting_names_its_flag(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineArgs(**kwargs).create_engine_config()


def test_engine_config_carries_every_setting():
    config = parse("--max-num-batched-tokens", "64", "--long-prefill-token-threshold", "32",
                   "--cpu-kv-cache-gib", "0.5", "--staging-queue-size", "4", "--kv-transfer", "direct",
                   "--kv-hold-timeout", "5", "--attention-backend", "torch").create_engine_config()
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.long_prefill_token_threshold,
            config.scheduler.staging_queue_size) == (64, 32, 4)
    assert config.cache.cpu_kv_cache_gib == 0.5 and config.kv_hold_timeout_s == 5.0
    assert config.attention_backend == "torch" and config.model.model == DEFAULT_MODEL
    staged = parse("--kv-transfer", "store", "--kv-store", "h:1", "--kv-staging-gib", "2.5").create_engine_config()
    assert staged.kv_staging_bytes == int(2.5 * 2**30)


def test_llm_names_unknown_options_before_loading_anything():
    from tandem.engine import LLM

    with pytest.raises(TypeError, match="unknown engine option.*'block_sise'"):
        LLM("smollm2", block_sise=16)


def test_a_command_may_skip_flags_and_set_its_own_defaults():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, skip=("kv_transfer", "kv_store"), defaults={"device": "cpu"})
    args = p.parse_args([])
    assert not hasattr(args, "kv_transfer") and args.device == "cpu"
    assert EngineArgs.from_cli_args(args).kv_transfer == "none"


def test_the_default_model_is_written_once():
    """One constant (engine/config.py); every command's --model default is it."""
    name = '"' + DEFAULT_MODEL + '"'
    files = [p for folder in ("engine", "services", "bench", "kernels")
             for p in (REPO / folder).rglob("*.py") if name in p.read_text()]
    assert [p.relative_to(REPO).as_posix() for p in files] == ["engine/config.py"]


def test_importing_the_engine_config_loads_no_torch():
    code = "import sys, tandem.engine.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_engine_sets_the_process_kernels_from_its_config():
    """kernels/ops.py does not read the environment: the engine tells it."""
    from tandem.bench.presets import preset_config
    from tandem.engine import LLM
    from tandem.kernels import ops

    def tiny(**kwargs):
        return LLM("llama-3-tiny", load_format="dummy", hf_config=preset_config("llama-3-tiny"),
                   num_blocks=8, **kwargs)

    try:
        tiny(attention_backend="torch")
        assert ops.attention_backend() == "torch" and not ops.triton_backend_selected()
        tiny()
        assert ops.attention_backend() == "auto" and ops.triton_backend_selected()
        if not __import__("torch").cuda.is_available():
            with pytest.raises(ValueError, match="--attention-backend triton needs CUDA; this engine runs on cpu"):
                tiny(attention_backend="triton")
    finally:
        ops.set_attention_backend("auto", "cpu")


def test_swap_space_is_checked_and_goes_with_a_kv_transfer():
    assert EngineArgs(swap_space=0.5).create_engine_config().cache.swap_space_gib == 0.5
    with pytest.raises(ConfigError, match="--swap-space"):
        EngineArgs(swap_space=-1.0).create_engine_config()
    assert EngineArgs(swap_space=1.0, kv_transfer="direct").create_engine_config().cache.swap_space_gib == 1.0


@pytest.mark.parametrize("gpu,gib,offline,limits", [
    ("NVIDIA H100 80GB HBM3", 80, True, (1024, 16384)),
    ("NVIDIA H200", 141, False, (1024, 8192)),
    ("NVIDIA A100-SXM4-80GB", 80, True, (256, 8192)),  # larger batches measured slower there
    ("NVIDIA L4", 23, True, (256, 8192)),
], ids=["h100-offline", "h200-serving", "a100", "l4"])
def test_batch_limits_follow_the_gpus_memory(monkeypatch, gpu, gib, offline, limits):
    """No GPU runs here: the device's name and memory are what the rule reads
    (the GPU test checks a real one)."""
    import types

    import torch

    from tandem.engine.config import default_batch_limits

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name=gpu, total_memory=gib * 2**30))
    assert default_batch_limits("cuda", offline) == limits


def test_batch_limits_given_or_decided_on_the_cpu():
    config = EngineArgs(device="cpu").create_engine_config().with_defaults()
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (256, 2048)
    config = EngineArgs(device="cpu", max_num_seqs=7, max_num_batched_tokens=99).create_engine_config()
    assert (config.with_defaults().scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (7, 99)


def test_heads_outer_blocks_reach_the_cache_config_and_are_refused_where_blocks_move_as_bytes():
    assert parse().create_engine_config().cache.block_layout == "NHD"
    assert parse("--kv-cache-layout", "HND").create_engine_config().cache.block_layout == "HND"
    with pytest.raises(ConfigError, match="'NDH' is not one of NHD, HND"):
        EngineArgs(kv_cache_layout="NDH").create_engine_config()
    for kwargs, flags in (({"kv_transfer": "direct"}, "--kv-transfer direct"),
                          ({"kv_transfer": "nixl"}, "--kv-transfer nixl"),
                          ({"kv_transfer": "nixl", "tensor_parallel_size": 2},
                           "--kv-transfer nixl or --tensor-parallel-size above 1")):
        with pytest.raises(ConfigError, match=f"--kv-cache-layout HND does not yet work with {flags}:"):
            EngineArgs(kv_cache_layout="HND", **kwargs).create_engine_config()
    # the store connector and the host tier index the cache: either layout
    config = EngineArgs(kv_cache_layout="HND", kv_transfer="store", kv_store="h:1",
                        swap_space=1.0).create_engine_config()
    assert (config.cache.block_layout, config.kv_transfer, config.cache.swap_space_gib) == ("HND", "store", 1.0)
