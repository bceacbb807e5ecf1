"""A real Prometheus server (Debian's `prometheus` package) scraping a local
tandem stack, for tests.

    with PrometheusServer({"router": ["127.0.0.1:8000"], ...}) as prom:
        prom.wait_for_targets_up()
        for labels, value in prom.query('sum(tandem:num_requests_running{role="decode"})'):
            ...

One scrape job per role, each target labelled with that `role`; scrape
interval 1 s; listens on a free loopback port; data in a temporary directory
that `close()` removes. Nothing is written or read remotely.

Without the `prometheus` binary, `start()` raises PrometheusNotInstalled, which
fails the test that needed it: a test of the live metrics must not silently
pass on a machine that lacks the server.
"""
from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

import httpx
import yaml

from tests.support.ports import free_port

SCRAPE_INTERVAL_S = 1.0


class PrometheusNotInstalled(RuntimeError):
    pass


def scrape_config(targets: Mapping[str, Sequence[str]], interval_s: float = SCRAPE_INTERVAL_S) -> dict:
    """prometheus.yml for `targets` (role -> host:port list, all on /metrics).

    honor_labels: every tandem series already carries its own `role` label; a
    target label of the same name would otherwise push the scraped one to
    `exported_role`. With it, a process that labels itself with the wrong role
    shows up under that role, which the live test checks against the job.
    """
    interval = f"{interval_s:g}s"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": role, "metrics_path": "/metrics", "honor_labels": True,
             "scrape_timeout": interval,
             "static_configs": [{"targets": list(hosts), "labels": {"role": role}}]}
            for role, hosts in sorted(targets.items())
        ],
    }


class PrometheusServer:
    def __init__(self, targets: Mapping[str, Sequence[str]], port: Optional[int] = None,
                 startup_timeout_s: float = 30.0) -> None:
        self.targets = {role: list(hosts) for role, hosts in targets.items()}
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="tandem-prometheus-")
        self._process: Optional[subprocess.Popen] = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self._dir.name) / "prometheus.log"

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> "PrometheusServer":
        binary = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists()
                                                else None)
        if binary is None:
            raise PrometheusNotInstalled(
                "the prometheus server is not installed, and this test needs a real one: install it "
                "(Debian/Ubuntu: apt-get install -y prometheus; CI's .ci/run does this)")
        config = Path(self._dir.name) / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(self.targets)))
        argv = [binary, f"--config.file={config}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                f"--storage.tsdb.path={Path(self._dir.name) / 'data'}",
                "--storage.tsdb.retention.time=1h", "--log.level=warn"]
        self._log = open(self.log_path, "wb")
        self._process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self._wait_until_ready()
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited with code {self._process.returncode}; "
                                   f"its log:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus on port {self.port} not ready within "
                                   f"{self.startup_timeout_s:g}s; its log:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, lines: int = 30) -> str:
        if self._log:
            self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Terminate (SIGTERM; SIGKILL after 10 s) and wait; idempotent."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- HTTP API ----------------------------------------------------------------------

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) per sample of the result vector, or
        one ({}, value) for a scalar. Raises ValueError with Prometheus's own
        message on a query it rejects."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        if body.get("status") != "success":
            raise ValueError(f"prometheus rejected {expr!r}: {body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        if data["resultType"] != "vector":
            raise ValueError(f"{expr!r} gave a {data['resultType']}, not an instant vector")
        return [(sample["metric"], float(sample["value"][1])) for sample in data["result"]]

    def value(self, expr: str) -> Optional[float]:
        """The single finite value of `expr`, or None while it has none (no
        series yet, or NaN, e.g. a quantile of a histogram with no recent data)."""
        result = self.query(expr)
        if len(result) != 1 or not math.isfinite(result[0][1]):
            return None
        return result[0][1]

    def wait_for_value(self, expr: str, timeout_s: float = 30.0) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            v = self.value(expr)
            if v is not None:
                return v
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr!r} gave no single finite value within {timeout_s:g}s; "
                                     f"last result: {self.query(expr)}")
            time.sleep(0.2)

    def targets_health(self) -> list[dict]:
        body = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()
        return body["data"]["activeTargets"]

    def wait_for_targets_up(self, scrapes: int = 2, timeout_s: float = 30.0) -> None:
        """Until every configured target has been scraped successfully at least
        `scrapes` times (so rate() over the data has two points)."""
        expected = sum(len(h) for h in self.targets.values())
        expr = f"count(count_over_time(up[1m]) >= {scrapes} and min_over_time(up[1m]) == 1)"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.value(expr) == expected:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"prometheus did not scrape all {expected} targets {scrapes} times within {timeout_s:g}s: "
                    + "; ".join(f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}"
                                for t in self.targets_health()))
            time.sleep(0.2)
