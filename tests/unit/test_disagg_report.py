"""bench/disagg_report.py reads gpu_disagg.sh's folders and recomputes the
highest sustained rate under other TPOT SLOs from the per-request records."""
from __future__ import annotations

import json
import os

from tandem.bench.disagg_report import highest_rate_within, load, slo_table


def record(ttft_s: float, tpot_s: float, success: bool = True) -> dict:
    return {"success": success, "ttft_s": ttft_s, "tpot_s": tpot_s}


def write_deployment(root: str, name: str, by_rate: dict[int, list[dict]]) -> None:
    mix = os.path.join(root, name, "long")
    points = []
    for rate, reqs in by_rate.items():
        folder = os.path.join(mix, name, f"rate-{rate}")
        os.makedirs(folder)
        with open(os.path.join(folder, "results.json"), "w") as f:
            json.dump({"config": {}, "summary": {}, "requests": reqs}, f)
        points.append({"rate": rate, "summary": {
            "goodput": 1.0, "slo_attainment": 1.0, "request_throughput": 1.0,
            "ttft_ms": {"p90": 1.0}, "tpot_ms": {"p90": 1.0}, "slos_ms": {"ttft": 1000, "tpot": 50}}})
    with open(os.path.join(mix, "sweep.json"), "w") as f:
        json.dump({"points": points}, f)


def test_highest_rate_follows_the_slo() -> None:
    requests = {
        4: [record(0.2, 0.030)] * 10,
        8: [record(0.3, 0.045)] * 9 + [record(0.3, 0.060)],  # 90% within 50 ms
        16: [record(0.5, 0.040)] * 8 + [record(2.0, 0.040)] * 2,  # 80%: TTFT misses
    }
    assert highest_rate_within(requests, 1000, 50) == 8
    assert highest_rate_within(requests, 1000, 40) == 4
    assert highest_rate_within(requests, 1000, 25) is None
    assert highest_rate_within(requests, 2500, 40) == 16
    requests[4][0] = record(0.2, 0.030, success=False)
    assert highest_rate_within({4: requests[4]}, 1000, 50) == 4  # 9 of 10 still meet


def test_slo_table_from_gpu_disagg_folders(tmp_path):
    write_deployment(str(tmp_path), "disagg", {4: [record(0.2, 0.02)] * 10, 8: [record(1.5, 0.02)] * 10})
    write_deployment(str(tmp_path), "coloc", {4: [record(0.2, 0.04)] * 10, 8: [record(0.3, 0.045)] * 10})
    results = load([str(tmp_path)])
    assert list(results) == ["coloc", "disagg"]
    table = slo_table(results, "long", ttft_ms=1000, tpot_slos=[30, 50]).splitlines()
    assert table[2:] == ["| 30 | none | 4 |", "| 50 | 8 | 4 |"]
