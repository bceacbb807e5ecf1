"""The whole tandem stack for tests: `tandem up` as a real process on free
loopback ports, with handles to kill and restart single children (fault
tests) and to read each process's Prometheus metrics.

Use the `tandem_stack` fixture. A stack takes a minute or two to start on two
cores, so stacks are shared: every module asking for the same StackOptions
gets the same stack, stopped after the last of those modules (modules run in
file order, so modules sharing a stack are best named next to each other). A
module that kills children asks for `private=True` and gets its own, stopped
when the module ends.

A killed child stays dead (`tandem up --no-restart --keep-going`): fault tests
study the stack without it, and `restart()` brings it back by hand. Tests of
the launcher's own policies ask for `when_child_exits="restart"` or `"stop"`.

Options per module: `TANDEM_STACK_OPTIONS = StackOptions(...)` at module
level, or indirect parametrization with a StackOptions.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import httpx
import pytest

from tandem.services.common.parent_death import die_with_parent
from tests.support.ports import free_port

START_TIMEOUT_S = float(os.environ.get("TANDEM_TEST_STACK_TIMEOUT", "300"))
_EXIT_FLAGS = {"leave": ("--no-restart", "--keep-going"), "restart": (), "stop": ("--no-restart",)}


@dataclass(frozen=True)
class StackOptions:
    prefill: int = 1
    decode: int = 1
    store: str = "memory"  # or a redis:// URL
    extra_args: tuple[str, ...] = ()  # more `tandem up` flags
    private: bool = False  # True: not shared (the module kills or restarts children)
    # What the launcher does when a child exits: "leave" it dead (--no-restart
    # --keep-going), "restart" it (tandem up's default), or "stop" the stack (--no-restart).
    when_child_exits: str = "leave"
    env: tuple[tuple[str, str], ...] = ()  # more environment for `tandem up` and its children


# `tandem up --prefill 2 --decode 2`, shared by the suites that need two of
# each (poison requests, text through the split, abort during prefill). 600
# KV blocks (9,600 tokens, more than SmolLM2's context) instead of the CPU
# default's 1 GiB per engine: shared stacks stay up for the whole session.
TWO_BY_TWO = StackOptions(prefill=2, decode=2, extra_args=("--num-blocks", "600"))


class TandemStack:
    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.dir = tempfile.mkdtemp(prefix="tandem-stack-")
        self.state_file = os.path.join(self.dir, "state.json")
        self.http_port = free_port()
        self.launcher: Optional[subprocess.Popen] = None
        self.state: dict = {}
        self.model = ""
        self._restarted: list[subprocess.Popen] = []

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> "TandemStack":
        o = self.options
        argv = [sys.executable, "-m", "tandem.services.launcher", "up", "--port", str(self.http_port),
                "--grpc-port", str(free_port()), "--prefill", str(o.prefill), "--decode", str(o.decode),
                "--store", o.store, "--state-file", self.state_file, "--log-dir", self.dir,
                *_EXIT_FLAGS[o.when_child_exits], *o.extra_args]
        self._launcher_log = open(os.path.join(self.dir, "launcher.log"), "wb")
        # The launcher gets SIGTERM if this process dies (say by the OOM killer)
        # and stops its stack; a stack left running held gigabytes.
        self.launcher = subprocess.Popen(argv, stdout=self._launcher_log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=dict(os.environ, **dict(o.env)),
                                         preexec_fn=die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(self.state_file):
            if self.launcher.poll() is not None:
                raise RuntimeError(f"tandem up exited with {self.launcher.returncode}:\n{self.launcher_log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tandem up not ready after {START_TIMEOUT_S}s:\n{self.launcher_log()}")
            time.sleep(0.2)
        self.refresh()
        # `tandem up` calls the stack up once the router counts every engine
        # healthy: a first request must go through prefill and decode alike.
        instances = httpx.get(f"{self.http_url}/health", timeout=10).json()["instances"]
        assert all(c["healthy"] == c["total"] for c in instances.values()), instances
        self.model = httpx.get(f"{self.http_url}/v1/models", timeout=10).json()["data"][0]["id"]
        return self

    def refresh(self) -> None:
        """Read the launcher's state file again (it rewrites it when it restarts a child)."""
        with open(self.state_file) as f:
            self.state = json.load(f)

    def stop(self) -> None:
        """Always safe to call; leaves no process behind."""
        try:
            self.refresh()  # the pids of children the launcher restarted
        except (OSError, ValueError):
            pass
        if self.launcher and self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)
            try:
                self.launcher.wait(30)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
                self.launcher.wait()
        for child in self.state.get("children", []):
            _kill_pid(child["pid"])
        for proc in self._restarted:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if getattr(self, "_launcher_log", None):
            self._launcher_log.close()

    def launcher_log(self, last_chars: Optional[int] = 6000) -> str:
        """What `tandem up` printed (its last `last_chars`; None: all of it)."""
        try:
            with open(os.path.join(self.dir, "launcher.log"), errors="replace") as f:
                text = f.read()
        except OSError:
            return ""
        return text[-last_chars:] if last_chars else text

    # --- where things are ----------------------------------------------------------------

    @property
    def http_url(self) -> str:
        return f"http://{self.state['http_address']}"

    @property
    def base_url(self) -> str:
        return f"{self.http_url}/v1"

    @property
    def grpc_target(self) -> str:
        return self.state["grpc_address"]

    @property
    def kvstore_target(self) -> str:
        return self.child("kvstore")["address"]

    @property
    def children(self) -> list[dict]:
        return self.state["children"]

    def child(self, name: str) -> dict:
        for c in self.children:
            if c["name"] == name:
                return c
        raise KeyError(f"no child {name!r}; have {[c['name'] for c in self.children]}")

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Child name (router, kvstore, prefill-0, decode-1, ...) -> its /metrics URL."""
        urls = {}
        for c in self.children:
            if c["role"] == "router":
                urls[c["name"]] = f"{self.http_url}/metrics"
            else:
                urls[c["name"]] = f"http://127.0.0.1:{c['metrics_port']}/metrics"
        return urls

    # --- metrics -----------------------------------------------------------------------

    def metric(self, name: str, metric: str, **labels: str) -> float:
        """Sum of the samples of `metric` (exposed name, e.g. tandem:prompt_tokens_total)
        on child `name` whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.metrics_urls[name], timeout=10).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == metric and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def running_after(self, role: str, timeout_s: float = 20.0) -> float:
        """Requests running on every instance of `role`, polled until none or timeout_s."""
        names = [c["name"] for c in self.children if c["role"] == role]
        deadline = time.monotonic() + timeout_s
        while True:
            running = sum(self.metric(n, "tandem:num_requests_running") for n in names)
            if running == 0 or time.monotonic() > deadline:
                return running
            time.sleep(0.5)

    # --- faults ------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL one child (the launcher leaves it dead unless `when_child_exits` says otherwise)."""
        child = self.child(name)
        _kill_pid(child["pid"])
        deadline = time.monotonic() + 10
        while _alive(child["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)

    def restart(self, name: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start a killed child again with its own command line on its old port."""
        child = self.child(name)
        argv = list(child["argv"])
        port = child["address"].rsplit(":", 1)[1]
        argv[argv.index("--port") + 1] = port
        log_path = child["log_path"] + ".restarted"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(os.environ, **child.get("env", {})))
        self._restarted.append(proc)
        child["pid"] = proc.pid
        deadline = time.monotonic() + timeout_s
        marker = f"{child['role']} listening on"
        while True:
            with open(log_path, errors="replace") as f:
                if marker in f.read():
                    return
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"restarting {name} failed:\n{f.read()[-4000:]}")
            time.sleep(0.1)

    def wait_restarted(self, name: str, old_pid: int, timeout_s: float = START_TIMEOUT_S) -> dict:
        """With when_child_exits="restart": wait until the launcher has restarted child `name`
        (a pid other than old_pid in the state file) and said it listens again;
        returns the child's new state."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.refresh()
            child = self.child(name)
            again = f"{name} listening on {child['address']} again"
            if child["pid"] != old_pid and again in self.launcher_log(None):
                return child
            if self.launcher.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not restarted:\n{self.launcher_log()}")
            time.sleep(0.2)


def owned_stack(options: StackOptions) -> Iterator[TandemStack]:
    """A stack one module owns (a fixture's body: `yield from owned_stack(...)`),
    stopped when the fixture ends, also when it failed to start."""
    stack = TandemStack(options)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of the launcher counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill_pid(pid: Optional[int]) -> None:
    if pid and _alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# Shared stacks live until the last module that asks for them has run (or
# the session ends): every engine holds one to two GiB, and a stack kept for
# the whole session beside the private ones of fault tests used to exhaust a
# 24 GiB machine. (A module-level registry instead of a session fixture, so
# that importing `tandem_stack` alone is enough for a test module.)
_SHARED: dict[StackOptions, TandemStack] = {}
_LAST_USER: dict[StackOptions, str] = {}  # options -> nodeid of the last module using them


def _stop_shared() -> None:
    while _SHARED:
        _SHARED.popitem()[1].stop()


def _options(request) -> StackOptions:
    return (getattr(request, "param", None) or getattr(request.module, "TANDEM_STACK_OPTIONS", None)
            or StackOptions())


def _last_module_using(request, options: StackOptions) -> str:
    """The module, among the items this session runs, that uses `options` last."""
    if not _LAST_USER:
        for item in request.session.items:
            if "tandem_stack" not in getattr(item, "fixturenames", ()):
                continue
            callspec = getattr(item, "callspec", None)
            used = ((callspec.params.get("tandem_stack") if callspec else None)
                    or getattr(item.module, "TANDEM_STACK_OPTIONS", None) or StackOptions())
            _LAST_USER[used] = item.module.__name__
    return _LAST_USER.get(options, "")


@pytest.fixture(scope="module")
def tandem_stack(request) -> Iterator[TandemStack]:
    options = _options(request)
    if options.private or options not in _SHARED:
        stack = TandemStack(options)
        try:
            stack.start()
        except BaseException:
            stack.stop()
            raise
        if options.private:
            try:
                yield stack
            finally:
                stack.stop()
            return
        if not _SHARED:
            request.config.add_cleanup(_stop_shared)
        _SHARED[options] = stack
    yield _SHARED[options]
    if _last_module_using(request, options) == request.module.__name__:
        _SHARED.pop(options).stop()
