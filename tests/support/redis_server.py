"""A real `redis-server` on a free loopback port, for tests.

    with RedisServer() as redis:        # started, answers PING
        backend = RedisBackend(redis.url)
        redis.stop(); ...; redis.start()  # or redis.restart(): same port, empty data

No persistence (`--save ""`, `--appendonly no`), files in a temporary
directory. Without the `redis-server` binary, `start()` raises
`RedisNotInstalled`, which fails the test that needed it: tests that need
Redis must not silently pass on a machine that lacks it.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from tests.support.ports import free_port


class RedisNotInstalled(RuntimeError):
    pass


class RedisServer:
    def __init__(self, port: Optional[int] = None, startup_timeout_s: float = 10.0) -> None:
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="tandem-redis-")
        self._process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return Path(self._dir.name) / "redis.log"

    def start(self) -> "RedisServer":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisNotInstalled(
                "redis-server is not installed, and these tests need a real Redis: install it "
                "(Debian/Ubuntu: apt-get install -y redis-server; CI's .ci/run does this)")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
                "--logfile", str(self.log_path)]
        self._process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_until_ready()
        return self

    def _wait_until_ready(self) -> None:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5,
                             socket_timeout=0.5)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if self._process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with code {self._process.returncode} on "
                                       f"port {self.port}; its log:\n{self._log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING within "
                                       f"{self.startup_timeout_s:g}s; its log:\n{self._log_tail()}")
                time.sleep(0.05)
        finally:
            client.close()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Terminate (SIGTERM; SIGKILL after 5 s) and wait; idempotent."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        """Stop and start again on the same port; the data is gone (no persistence)."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
