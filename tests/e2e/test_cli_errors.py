"""Mistakes on the command line stop `tandem up` and `tandem serve router` at
once with one `error: ...` line and status 2, never a traceback: an empty API
key (it used to turn authentication off), a model that is not there. And the
banner's curl line hands the API key to the shell to expand."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def tandem(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.services.launcher", *argv],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
                          env=dict(os.environ, **(env or {})))


def up(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return tandem("up", "--port", str(free_port()), "--grpc-port", str(free_port()), *argv, env=env)


def router(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return tandem("serve", "router", "--port", "0", "--grpc-port", "-1", "--decode", "127.0.0.1:1",
                  "--startup-timeout", "0.1", *argv, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess, starts: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(starts), result.stderr


EMPTY_KEYS = {
    "flag": (["--api-key", ""], {}),
    "env": ([], {"TANDEM_API_KEY": ""}),
    "env item": ([], {"TANDEM_API_KEY": "secret,"}),
}


@pytest.mark.parametrize("command", [up, router], ids=["up", "serve router"])
@pytest.mark.parametrize("how", list(EMPTY_KEYS))
def test_an_empty_api_key_is_an_error_at_start(command, how):
    argv, env = EMPTY_KEYS[how]
    result = command(*argv, env=env)
    assert_one_line_error(result, "error: --api-key: empty key; give non-empty keys")
    assert "unset to serve without authentication" in result.stderr


@pytest.mark.parametrize("command", [up, router], ids=["up", "serve router"])
def test_a_missing_model_is_an_error_that_says_where_it_looked(command, tmp_path):
    missing = str(tmp_path / "no-such-model")
    result = command("--model", missing)
    assert_one_line_error(result, f"error: --model: model {missing!r} not found: no folder or file {missing}")
    assert "'smollm2' for the embedded SmolLM2-135M-Instruct" in result.stderr


@pytest.mark.parametrize("command", [up, router], ids=["up", "serve router"])
def test_a_hub_id_missing_from_the_cache_offline_is_told_how_to_fill_it(command, tmp_path):
    """Offline (and no network in tests): the Hub cache only, and a clear error."""
    cache = str(tmp_path / "hub")
    result = command("--model", "meta-llama/Llama-3.1-8B", "--revision", "v1", "--download-dir", cache,
                     env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(result, "error: --model: model 'meta-llama/Llama-3.1-8B' (revision v1) is not "
                                  f"in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set")
    assert f"hf download meta-llama/Llama-3.1-8B --revision v1 --cache-dir {cache}" in result.stderr


def test_banner_curl_lets_the_shell_expand_the_api_key(capsys):
    import argparse

    from tandem.services.launcher.children import Child
    from tandem.services.launcher.up import _print_banner

    router_child = Child(name="router", role="router", argv=[], log_path="", address="127.0.0.1:8000")
    _print_banner(router_child, "127.0.0.1:50051", argparse.Namespace(api_key=["k"]), "m",
                  [router_child], "/tmp/logs")
    header = re.search(r"curl \S+ -H '[^']*'( -H \S+ \S+ \S+)", capsys.readouterr().out).group(1)
    # What bash passes to curl for that part of the printed line.
    expanded = subprocess.run(["bash", "-c", f"printf '%s|' {header}"], capture_output=True, text=True,
                              env=dict(os.environ, TANDEM_API_KEY="s3cret")).stdout
    assert expanded == "-H|Authorization: Bearer s3cret|"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_store_without_its_address_is_an_error_before_the_model_loads(role):
    result = tandem("serve", role, "--port", "0", "--metrics-port", "0", "--kv-transfer", "store")
    assert_one_line_error(result, "error: --kv-transfer store needs --kv-store HOST:PORT")


def test_the_old_kv_flags_are_gone():
    result = tandem("serve", "decode", "--kv-direct")
    assert result.returncode == 2 and "unrecognized arguments: --kv-direct" in result.stderr


def test_up_checks_engine_settings_before_starting_anything(tmp_path):
    result = up("--block-size", "0", "--log-dir", str(tmp_path))
    assert_one_line_error(result, "error: --block-size: must be above 0, got 0")
    assert list(tmp_path.iterdir()) == []
    result = up("--restart-backoff", "0", "--log-dir", str(tmp_path))
    assert_one_line_error(result, "error: --restart-backoff: must be above 0, got 0")
    assert list(tmp_path.iterdir()) == []


def test_up_checks_each_roles_own_settings(tmp_path):
    result = up("--kv-transfer", "nixl", "--decode-tensor-parallel-size", "2", "--log-dir", str(tmp_path))
    assert_one_line_error(result, "error: --tensor-parallel-size above 1 does not work with --kv-transfer nixl")
    assert list(tmp_path.iterdir()) == []
