"""Writing results down: the summary table for people, JSON and plots for files."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Optional

from tandem.bench.metrics import LatencyStats, Summary

if TYPE_CHECKING:  # imported for types only; serve imports this module
    from tandem.bench.serve import ServeResult

RESULTS_JSON = "results.json"
LATENCY_CDF_PNG = "latency_cdf.png"
TIMELINE_PNG = "timeline.png"


def _num(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_table(s: Summary, title: str = "Serving benchmark") -> str:
    width = 64
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<44}{value:>20}")

    row("Successful requests:", str(s.completed))
    row("Failed requests:", str(s.failed))
    row("Benchmark duration (s):", _num(s.duration_s))
    row("Request throughput (req/s):", _num(s.request_throughput, 3))
    row("Input token throughput (tok/s):", _num(s.input_token_throughput))
    row("Output token throughput (tok/s):", _num(s.output_token_throughput))
    row("Total token throughput (tok/s):", _num(s.total_token_throughput))
    if s.goodput is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in s.slos_ms.items())
        row(f"Goodput (req/s) [{slos}]:", _num(s.goodput, 3))
        row("Requests meeting all SLOs:", f"{s.good_requests}/{s.completed + s.failed} "
                                          f"({100 * (s.slo_attainment or 0):.0f}%)")
    lines.append("-" * width)
    lines.append(f"{'latency (ms)':<16}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    stats: list[tuple[str, LatencyStats]] = [("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms),
                                             ("E2E", s.e2e_ms)]
    for name, st in stats:
        lines.append(f"{name:<16}{_num(st.mean):>12}{_num(st.p50):>12}{_num(st.p90):>12}{_num(st.p99):>12}")
    lines.append("=" * width)
    return "\n".join(lines)


def write_json(data: dict, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def write_serve_result(result: "ServeResult", result_dir: str) -> list[str]:
    from tandem.bench import plots

    os.makedirs(result_dir, exist_ok=True)
    paths = [write_json(result.to_json(), os.path.join(result_dir, RESULTS_JSON))]
    paths.append(plots.latency_cdfs(result.records, os.path.join(result_dir, LATENCY_CDF_PNG)))
    paths.append(plots.timeline(result.records, os.path.join(result_dir, TIMELINE_PNG)))
    return paths
