"""`tandem up`'s plan: every child gets a port fixed by the launcher (never
port 0), so a restarted child comes back where the others expect it."""
from __future__ import annotations

import argparse

from tandem.services.launcher.plan import plan_stack
from tandem.services.launcher.up import add_up_arguments


def plan(*argv: str, tmp_path) -> tuple:
    p = argparse.ArgumentParser()
    add_up_arguments(p)
    return plan_stack(p.parse_args(["--prefill", "2", "--decode", "2", *argv]), str(tmp_path))


def flag(argv: list[str], name: str) -> int:
    return int(argv[argv.index(name) + 1])


def test_every_child_gets_its_own_fixed_port(tmp_path):
    kvstore, prefills, decodes, router_flags = plan("--port", "0", "--grpc-port", "0", tmp_path=tmp_path)
    children = [kvstore, *prefills, *decodes]
    ports = [flag(c.argv, "--port") for c in children] + [c.metrics_port for c in children]
    ports += [flag(router_flags, "--port"), flag(router_flags, "--grpc-port")]
    assert all(p > 0 for p in ports) and len(set(ports)) == len(ports), ports
    assert all(flag(c.argv, "--metrics-port") == c.metrics_port for c in children)


def test_given_ports_are_kept_and_a_turned_off_grpc_api_stays_off(tmp_path):
    kvstore, _, _, router_flags = plan("--port", "18123", "--grpc-port", "-1", "--kvstore-port", "18124",
                                       tmp_path=tmp_path)
    assert flag(kvstore.argv, "--port") == 18124
    assert (flag(router_flags, "--port"), flag(router_flags, "--grpc-port")) == (18123, -1)


def engine_args_of(argv: list[str]):
    """What an engine started with `argv` runs with (its own parser, no environment)."""
    from tandem.engine.config import EngineArgs
    from tandem.services.prefill.server import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return EngineArgs.from_cli_args(p.parse_args(argv[argv.index("-m") + 2:]))  # after the module


def test_engines_get_the_engine_flags_as_given_and_the_store_the_launcher_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_BLOCK_SIZE", raising=False)
    kvstore, prefills, decodes, router_flags = plan(
        "--kvstore-port", "18125", "--block-size", "32", "--max-model-len", "512", "--enforce-eager",
        "--no-prefix-caching", "--attention-backend", "torch", tmp_path=tmp_path)
    for child in prefills + decodes:
        assert child.argv[child.argv.index("--kv-transfer") + 1] == "store"
        assert child.argv[child.argv.index("--kv-store") + 1] == "127.0.0.1:18125"
    args = engine_args_of(prefills[0].argv)
    assert (args.block_size, args.max_model_len, args.enforce_eager, args.enable_prefix_caching,
            args.attention_backend) == (32, 512, True, False, "torch")
    # The router reads the context length from the engines, never its own copy.
    assert "--max-model-len" not in router_flags and "--block-size" not in router_flags


def test_direct_transfer_reaches_every_engine_without_a_store(tmp_path):
    _, prefills, decodes, _ = plan("--kv-transfer", "direct", tmp_path=tmp_path)
    for child in prefills + decodes:
        args = engine_args_of(child.argv)
        assert (args.kv_transfer, args.kv_store) == ("direct", None)


def test_engines_do_not_inherit_the_env_twins_the_launcher_already_read(tmp_path, monkeypatch):
    """TANDEM_BLOCK_SIZE=32 with `--block-size 16` given: the flag wins for the
    launcher, and the engine, which gets no --block-size (16 is the default),
    must not read 32 from its inherited environment."""
    import sys

    from tandem.services.launcher.children import start_child

    monkeypatch.setenv("TANDEM_BLOCK_SIZE", "32")
    monkeypatch.setenv("TANDEM_UNRELATED", "kept")
    _, prefills, _, _ = plan("--block-size", "16", tmp_path=tmp_path)
    assert "--block-size" not in prefills[0].argv
    probe = prefills[0]
    probe.argv = [sys.executable, "-c", "import os; print(os.environ.get('TANDEM_BLOCK_SIZE'), "
                  "os.environ.get('TANDEM_UNRELATED'))"]
    start_child(probe)
    probe.process.wait(30)
    assert open(probe.log_path).read().split() == ["None", "kept"]


def test_a_hub_revision_and_cache_reach_the_engines_and_the_router(tmp_path, monkeypatch):
    """The router reads the tokenizer of the same snapshot the engines read the weights of."""
    from tandem.services.router.server import add_arguments as add_router_arguments

    for name in ("TANDEM_REVISION", "TANDEM_DOWNLOAD_DIR"):
        monkeypatch.delenv(name, raising=False)
    _, prefills, decodes, router_flags = plan("--model", "org/tiny", "--revision", "v2",
                                              "--download-dir", "/hub", tmp_path=tmp_path)
    for child in prefills + decodes:
        args = engine_args_of(child.argv)
        assert (args.model, args.revision, args.download_dir) == ("org/tiny", "v2", "/hub")
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    router = p.parse_args(router_flags)
    assert (router.model, router.revision, router.download_dir) == ("org/tiny", "v2", "/hub")


def test_each_role_gets_its_own_tensor_parallel_size(tmp_path):
    _, prefills, decodes, _ = plan("--tensor-parallel-size", "3", "--decode-tensor-parallel-size", "2",
                                   tmp_path=tmp_path)
    assert {engine_args_of(c.argv).tensor_parallel_size for c in prefills} == {3}  # the common flag
    assert {engine_args_of(c.argv).tensor_parallel_size for c in decodes} == {2}  # its own
    _, prefills, decodes, _ = plan("--prefill-tensor-parallel-size", "2", tmp_path=tmp_path)
    assert [engine_args_of(c.argv).tensor_parallel_size for c in prefills + decodes] == [2, 2, 1, 1]


def test_gpus_go_to_engines_one_per_tensor_parallel_rank(tmp_path):
    _, prefills, decodes, _ = plan("--gpus", "0,1", tmp_path=tmp_path)  # TP=1: one GPU each, round robin
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in prefills + decodes] == ["0", "1", "0", "1"]
    _, prefills, decodes, _ = plan("--gpus", "0,1,2,3,4,5", "--prefill-tensor-parallel-size", "2",
                                   tmp_path=tmp_path)
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in prefills + decodes] == ["0,1", "2,3", "4", "5"]
    _, _, decodes, _ = plan("--gpus", "0,1,2", "--tensor-parallel-size", "2", tmp_path=tmp_path)
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in decodes] == ["1,2", "0,1"]  # round the list again
    _, prefills, _, _ = plan(tmp_path=tmp_path)
    assert "CUDA_VISIBLE_DEVICES" not in prefills[0].env  # unset: every engine sees all GPUs


def test_fewer_gpus_than_an_engines_ranks_is_refused(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="--gpus lists 1 GPU.* --tensor-parallel-size 2 needs 2"):
        plan("--gpus", "0", "--decode-tensor-parallel-size", "2", tmp_path=tmp_path)
