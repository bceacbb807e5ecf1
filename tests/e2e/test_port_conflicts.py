"""A taken port is an error at start, never silent sharing: gRPC turns
SO_REUSEPORT on by default, so before the fix a second server on a port
served half its calls. Every role, and `tandem up` before it starts anything,
stops with one line naming the port and the flag to change. /metrics binds
the role's --host."""
from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

import pytest

from tests.support.kvstore_process import start_store
from tests.support.ports import free_port, wait_for_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def first():
    """A kvstore holding its port, as a first `tandem up` (or role) would."""
    store = start_store()
    yield store
    store.stop()


def run(*argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout_s)


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


ROLES = {
    # Its data channel on a free port: the default (50082) may be any earlier
    # test's ephemeral port, and would be refused first (one CI run saw it).
    "kvstore": (["tandem.services.kvstore.server", "--data-port", "0"], "--port"),
    "prefill": (["tandem.services.prefill.server", "--metrics-port", "0", "--num-blocks", "64"], "--port"),
    "decode": (["tandem.services.decode.server", "--metrics-port", "0", "--num-blocks", "64"], "--port"),
    # The router's public gRPC API; it waits at most 0.1 s for its (absent) decode instance.
    "router": (["tandem.services.router.server", "--decode", "127.0.0.1:1", "--startup-timeout", "0.1",
                "--port", "0"], "--grpc-port"),
}


@pytest.mark.parametrize("role", list(ROLES))
def test_every_role_refuses_a_taken_port(first, role):
    argv, flag = ROLES[role]
    result = run(*argv, "--host", "127.0.0.1", flag, str(first.port))
    assert result.returncode != 0, result.stdout + result.stderr
    assert last_line(result) == (
        f"error: cannot listen on 127.0.0.1:{first.port}: the port is in use (another tandem "
        f"process?); pick another port with {flag} (0 picks a free one)"), result.stderr
    assert "Traceback" not in result.stderr
    assert f"{role} listening on" not in result.stdout


def test_up_refuses_a_taken_grpc_port_before_starting_anything(first, tmp_path):
    result = run("tandem.services.launcher", "up", "--port", str(free_port()),
                 "--grpc-port", str(first.port), "--log-dir", str(tmp_path), timeout_s=60)
    assert result.returncode == 2, result.stderr
    assert last_line(result) == (
        f"error: cannot listen on 127.0.0.1:{first.port}: the port is in use (another tandem "
        "process?); pick another port with --grpc-port (0 picks a free one)")
    assert list(tmp_path.iterdir()) == []  # no child was started


def test_metrics_bind_the_roles_host_and_refuse_a_taken_port():
    metrics_port = free_port()
    store = start_store("--metrics-port", str(metrics_port))  # start_store passes --host 127.0.0.1
    try:
        wait_for_port(metrics_port)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
            assert b"tandem:kvstore_puts_total" in page.read()
        # Another loopback address of this machine: a server on 0.0.0.0 would answer there.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", metrics_port), timeout=5).close()
        second = run("tandem.services.kvstore.server", "--host", "127.0.0.1", "--port", "0",
                     "--metrics-port", str(metrics_port))
    finally:
        store.stop()
    assert second.returncode != 0
    assert last_line(second) == (
        f"error: cannot serve metrics on 127.0.0.1:{metrics_port}: Address already in use; pick a "
        "free port with --metrics-port, or 0 to turn metrics off")
