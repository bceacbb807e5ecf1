"""A KV store server as a real process on loopback (python -m tandem.services.kvstore.server)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional


@dataclass
class StoreProcess:
    process: subprocess.Popen
    port: int
    log_path: str
    backend: str = "memory"
    final_log: Optional[str] = None  # kept once stop() removed the log file

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        if self.final_log is not None:
            return self.final_log
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> Optional[int]:
        """SIGTERM, wait, remove the log; returns the exit code. A store still
        running after 10 s gets SIGABRT, on which it writes every thread's stack
        into its log (the tail log() keeps), then SIGKILL."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.send_signal(signal.SIGABRT)
                try:
                    self.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        if self.final_log is None:
            self.final_log = self.log()
            os.unlink(self.log_path)
        return self.process.returncode


def start_store(*flags: str, timeout_s: float = 30.0) -> StoreProcess:
    """`python -m tandem.services.kvstore.server --port 0 FLAGS`, once it printed
    its listening line (stdout and stderr go to a log file)."""
    log = tempfile.NamedTemporaryFile(prefix="kvstore-", suffix=".log", delete=False)
    data = [] if "--data-port" in flags else ["--data-port", "0"]  # stores of parallel tests must not collide
    argv = [sys.executable, "-m", "tandem.services.kvstore.server", "--host", "127.0.0.1",
            "--port", "0", *data, *flags]
    # PYTHONFAULTHANDLER: SIGABRT dumps the stacks, for a store that will not stop.
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    store = StoreProcess(process, 0, log.name)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in store.log().splitlines():
            if line.startswith("kvstore listening on 127.0.0.1:"):
                store.port = int(line.rsplit(":", 1)[1])
                return store
        if process.poll() is not None:
            raise RuntimeError(f"kvstore exited with code {process.returncode}:\n{store.log()}")
        time.sleep(0.05)
    store.stop()
    raise RuntimeError(f"kvstore did not print its listening line in {timeout_s}s:\n{store.log()}")
