"""`tandem up` restarts a child that exits, on the port it had, after a
back-off; a child that cannot start again stops the stack with its log; with
--no-restart a dead child stops the stack. Real stacks on loopback, children
killed with SIGKILL."""
from __future__ import annotations

import re
import socket
import time

import httpx
import pytest

from tandem.services.launcher.supervisor import START_TRIES
from tests.support.stack import StackOptions, TandemStack, _alive, owned_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SMALL = ("--num-blocks", "64", "--max-model-len", "512")


# Restarts wait 0.25 s, 0.5, 1, 2, 4 in a row here (1 s, 2, ... by default): the
# doubling is what is tested, and five tries in the default take 31 s.
BACKOFF_S = 0.25


def private_stack(when_child_exits: str):
    yield from owned_stack(StackOptions(prefill=0, decode=1, extra_args=(*SMALL, "--restart-backoff", str(BACKOFF_S)),
                                        private=True, when_child_exits=when_child_exits))


@pytest.fixture(scope="module")
def restarting():
    yield from private_stack("restart")


@pytest.fixture(scope="module")
def stopping():
    yield from private_stack("stop")


def chat(stack: TandemStack) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/chat/completions", timeout=120, json={
        "model": stack.model, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})


def test_up_restarts_a_killed_engine_on_its_own_port(restarting):
    assert chat(restarting).status_code == 200
    old = dict(restarting.child("decode-0"))
    restarting.kill("decode-0")
    new = restarting.wait_restarted("decode-0", old["pid"])
    assert new["address"] == old["address"]
    assert new["pid"] != old["pid"] and _alive(new["pid"]) and new["restarts"] == 1
    assert (f"decode-0 (pid {old['pid']}) was killed by SIGKILL; restarting in {BACKOFF_S:g}s (restart 1)"
            in restarting.launcher_log(None))
    # The router knows the engine only by that address; it serves again once
    # a health round (every second) finds it back.
    deadline = time.monotonic() + 60
    while (r := chat(restarting)).status_code != 200 and time.monotonic() < deadline:
        time.sleep(1)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def take_port(port: int, timeout_s: float = 0.8) -> socket.socket:
    """Listen on `port` once the killed child's last thread has let go of it
    (its main thread shows as a zombie a moment earlier); the launcher's first
    restart comes a second later."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_server(("127.0.0.1", port))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_up_gives_up_on_a_child_that_cannot_start_again(restarting):
    """Runs last on its stack: the stack stops."""
    kvstore = restarting.child("kvstore")
    port = int(kvstore["address"].rsplit(":", 1)[1])
    restarting.kill("kvstore")
    with take_port(port):  # every restart now finds the port taken
        code = restarting.launcher.wait(timeout=180)
    log = restarting.launcher_log(None)
    assert code == 1, log
    delays = re.findall(r"\[tandem up\] kvstore \(pid \d+\) [^;]*; restarting in ([\d.]+)s", log)
    assert delays == [f"{BACKOFF_S * 2 ** i:g}" for i in range(START_TRIES)], log
    assert f"exited {START_TRIES} times in a row before listening: given up" in log
    # The tail of the kvstore's log says why, and what to change.
    assert f"error: cannot listen on 127.0.0.1:{port}: the port is in use" in log
    assert "stopping the whole stack" in log
    restarting.refresh()
    assert not any(_alive(c["pid"]) for c in restarting.children)


def test_up_with_no_restart_stops_the_stack_when_a_child_dies(stopping):
    pid = stopping.child("decode-0")["pid"]
    stopping.kill("decode-0")
    code = stopping.launcher.wait(timeout=60)
    log = stopping.launcher_log(None)
    assert code == 1, log
    assert f"error: decode-0 (pid {pid}) was killed by SIGKILL (--no-restart)" in log
    assert "restarting in" not in log
    assert not any(_alive(c["pid"]) for c in stopping.children)
