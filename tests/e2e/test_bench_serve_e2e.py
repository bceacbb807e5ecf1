"""`tandem bench serve` against the real stack (`tandem up`, embedded SmolLM2 on
the CPU): the benchmark runs as a user runs it, a subprocess, and its JSON and
plots must be consistent."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.stack import tandem_stack  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

NUM_PROMPTS = 8
OUTPUT_LEN = 8  # the CPU model makes ~20 tok/s: keep the run short
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tandem.bench.cli", "bench", *args, "--disable-tqdm"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def assert_consistent(summary: dict, requests: list[dict], sent: int) -> None:
    assert summary["completed"] + summary["failed"] == sent == len(requests)
    assert summary["failed"] == 0, [r["error"] for r in requests if not r["success"]]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert stats["count"] > 0, key
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], (key, stats)
    for r in requests:
        assert r["success"]
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["prompt_tokens"] > 0 and r["output_tokens"] > 0
        assert r["output_tokens"] == r["expected_output_len"]  # ignore_eos/min_tokens honoured
        assert len(r["itl_s"]) <= r["output_tokens"] - 1
    assert summary["output_token_throughput"] > 0 and summary["request_throughput"] > 0
    assert summary["good_requests"] <= summary["completed"]


def test_bench_serve_writes_consistent_json_and_plots(tandem_stack, tmp_path):  # noqa: F811
    out = tmp_path / "serve"
    proc = run_bench("serve", "--base-url", tandem_stack.base_url, "--num-prompts", str(NUM_PROMPTS),
                     "--request-rate", "4", "--random-input-len", "32", "--random-output-len", str(OUTPUT_LEN),
                     "--random-range-ratio", "0.5", "--goodput", "ttft:60000", "tpot:10000",
                     "--result-dir", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Successful requests:" in proc.stdout and "TTFT" in proc.stdout

    data = json.loads((out / "results.json").read_text())
    assert data["config"]["endpoint"]["model"] == tandem_stack.model  # found through GET /v1/models
    assert_consistent(data["summary"], data["requests"], NUM_PROMPTS)
    # SLOs this loose are met by every request of a healthy stack.
    assert data["summary"]["good_requests"] == NUM_PROMPTS
    for name in ("latency_cdf.png", "timeline.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name


def test_bench_sweep_plots_every_rate(tandem_stack, tmp_path):  # noqa: F811
    out = tmp_path / "sweep"
    proc = run_bench("sweep", "--target", f"tandem={tandem_stack.base_url}", "--request-rates", "2,inf",
                     "--dataset", "shared-prefix", "--prefix-groups", "2", "--prefix-len", "48",
                     "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4",
                     "--endpoint", "completions", "--result-dir", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "sweep.json").read_text())
    assert [(p["target"], p["rate"]) for p in data["points"]] == [("tandem", 2.0), ("tandem", "inf")]
    for point, rate_dir in zip(data["points"], ("rate-2", "rate-inf")):
        per_rate = json.loads((out / "tandem" / rate_dir / "results.json").read_text())
        assert per_rate["summary"] == point["summary"]
        assert_consistent(point["summary"], per_rate["requests"], 4)
    assert (out / "sweep.png").read_bytes()[:8] == PNG_MAGIC
