"""`tandem bench sweep`: serve at several request rates against several
deployments, and put them on one plot.

Every point sends the same requests (same dataset and seed); only the arrival
rate and the target change, so differences are the deployments'.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, replace
from typing import Optional

from tandem.bench import report
from tandem.bench.datasets import generate
from tandem.bench.metrics import Summary
from tandem.bench.serve import add_workload_flags, config_from_args, run_serve
from tandem.services.common.config import add_flag

SWEEP_JSON = "sweep.json"
SWEEP_PNG = "sweep.png"
ATTAINMENT_GOAL = 0.9  # DistServe's convention: a rate is sustained when 90% of requests meet the SLOs


@dataclass(frozen=True)
class Target:
    name: str
    base_url: str


@dataclass
class SweepPoint:
    target: str
    rate: float
    summary: Summary

    def to_json(self) -> dict:
        return {"target": self.target, "rate": _rate_json(self.rate), "summary": self.summary.to_json()}


def _rate_json(rate: float) -> object:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity


def parse_target(text: str) -> Target:
    name, sep, url = text.partition("=")
    if not sep or not name.strip() or not url.strip():
        raise ValueError(f"bad --target {text!r}: write NAME=BASE_URL, e.g. disagg=http://127.0.0.1:8000/v1")
    return Target(name.strip(), url.strip())


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"bad --request-rates {text!r}: write positive numbers separated by commas, e.g. 1,2,4,inf")
    return rates


def max_sustained_rate(points: list[SweepPoint], target: str) -> Optional[float]:
    """The highest finite rate at which SLO attainment reached the goal, below which every rate did too."""
    best = None
    for p in sorted((p for p in points if p.target == target), key=lambda p: p.rate):
        if math.isinf(p.rate) or p.summary.slo_attainment is None or p.summary.slo_attainment < ATTAINMENT_GOAL:
            break
        best = p.rate
    return best


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep", help="run `bench serve` over several request rates and deployments; plot goodput vs rate",
        description="For every --target and every rate of --request-rates, send the same generated requests "
                    "(see `tandem bench serve --help` for the workload flags) and plot goodput, p90 TTFT and "
                    "p90 TPOT against the rate, all deployments on one plot.")
    add_flag(p, "--target", action="extend", nargs="+", default=None, metavar="NAME=BASE_URL",
             help="deployments to measure, e.g. --target disagg=http://127.0.0.1:8000/v1 "
                  "coloc=http://127.0.0.1:9000/v1 (or repeat the flag)")
    add_flag(p, "--request-rates", default="1,2,4,8", help="comma-separated request rates (req/s); inf allowed")
    add_flag(p, "--seed-per-rate", type=bool, default=False,
             help="the k-th rate (0-based) draws its requests with seed --seed + k: each point sends prompts "
                  "no earlier point sent, so a server's prefix cache cannot serve them (every deployment "
                  "still gets the same requests at a given rate)")
    add_flag(p, "--result-dir", default="bench-sweep",
             help="where sweep.json, sweep.png and each point's results go (NAME/rate-R/)")
    add_workload_flags(p)
    p.set_defaults(handler=main, goodput=p.get_default("goodput") or ["ttft:1000", "tpot:50"])
    p.epilog = "Without --goodput the SLOs are ttft:1000 tpot:50 (ms)."


def main(args: argparse.Namespace) -> int:
    try:
        targets = [parse_target(t) for t in (args.target or [])]
        if not targets:
            raise ValueError("no deployment to measure: pass --target NAME=BASE_URL (repeat for several)")
        if len({t.name for t in targets}) != len(targets):
            raise ValueError("--target names must differ")
        rates = parse_rates(args.request_rates)
        configs = {t.name: config_from_args(args, t.base_url, rates[0]) for t in targets}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dataset = next(iter(configs.values())).dataset
    seed_of = {rate: dataset.seed + (k if args.seed_per_rate else 0) for k, rate in enumerate(rates)}
    requests = {seed: generate(replace(dataset, seed=seed)) for seed in set(seed_of.values())}
    points: list[SweepPoint] = []
    for target in targets:
        for rate in rates:
            config = configs[target.name]
            config = replace(config, load=replace(config.load, request_rate=rate),
                             dataset=replace(config.dataset, seed=seed_of[rate]))
            print(f"--- {target.name} at {rate:g} req/s", file=sys.stderr)
            result = run_serve(config, requests[seed_of[rate]])
            point_dir = os.path.join(args.result_dir, target.name, f"rate-{rate:g}")
            report.write_serve_result(result, point_dir)
            print(report.summary_table(result.summary, title=f"{target.name} @ {rate:g} req/s"))
            points.append(SweepPoint(target.name, rate, result.summary))
            # Keep what is done so far if a later point is interrupted.
            _write(points, targets, args.result_dir)
    paths = _write(points, targets, args.result_dir)
    for target in targets:
        best = max_sustained_rate(points, target.name)
        print(f"{target.name}: highest rate with >= {ATTAINMENT_GOAL:.0%} of requests within the SLOs: "
              f"{'none of the rates' if best is None else f'{best:g} req/s'}")
    print("wrote " + ", ".join(paths))
    return 0 if all(p.summary.completed for p in points) else 1


def _write(points: list[SweepPoint], targets: list[Target], result_dir: str) -> list[str]:
    from tandem.bench import plots

    data = {"targets": [{"name": t.name, "base_url": t.base_url,
                         "max_sustained_rate": max_sustained_rate(points, t.name)} for t in targets],
            "attainment_goal": ATTAINMENT_GOAL,
            "points": [p.to_json() for p in points]}
    return [report.write_json(data, os.path.join(result_dir, SWEEP_JSON)),
            plots.sweep(points, os.path.join(result_dir, SWEEP_PNG))]
