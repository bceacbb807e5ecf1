"""Tables and plots of bench/gpu_disagg.sh's results: one sweep per deployment
and mix, put side by side.

    python -m tandem.bench.disagg_report disagg-1p1d.tgz coloc-2.tgz --plots docs/img --prefix disagg_h100

Each argument is a deployment's tarball (or the folder it unpacks to):
NAME/MIX/sweep.json for every mix, NAME/MIX.metrics.txt the engines' /metrics
after that mix. Prints markdown: per mix, one row per rate with goodput, SLO
attainment, p90 TTFT and p90 TPOT of every deployment, the highest rate each
sustained (>= 90% of requests within the SLOs) and their ratio; then the KV
transfers the engines counted. Writes PREFIX_MIX.png per mix with --plots.
With --tpot-slos, also the highest rate per TPOT SLO, from the same runs'
per-request records (how the comparison depends on the SLO).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
import tarfile
import tempfile
from types import SimpleNamespace
from typing import Optional

MIXES = ("long", "sharegpt")


def load(paths: list[str]) -> dict[str, dict[str, dict]]:
    """{deployment: {mix: {"sweep": sweep.json, "metrics": text}}}."""
    out: dict[str, dict[str, dict]] = {}
    for path in paths:
        root = path
        if os.path.isfile(path):
            root = tempfile.mkdtemp(prefix="disagg-report-")
            with tarfile.open(path) as tar:
                tar.extractall(root, filter="data")
        for name in sorted(os.listdir(root)):
            folder = os.path.join(root, name)
            for mix in MIXES:
                sweep_json = os.path.join(folder, mix, "sweep.json")
                if not os.path.exists(sweep_json):
                    continue
                with open(sweep_json) as f:
                    entry = {"sweep": json.load(f), "metrics": "", "requests": _requests(folder, mix)}
                metrics = os.path.join(folder, f"{mix}.metrics.txt")
                if os.path.exists(metrics):
                    with open(metrics) as f:
                        entry["metrics"] = f.read()
                out.setdefault(name, {})[mix] = entry
    return out


def _requests(folder: str, mix: str) -> dict[float, list[dict]]:
    """{rate: every request's record} from NAME/MIX/TARGET/rate-R/results.json."""
    out: dict[float, list[dict]] = {}
    for path in glob.glob(os.path.join(folder, mix, "*", "rate-*", "results.json")):
        rate = os.path.basename(os.path.dirname(path)).removeprefix("rate-")
        with open(path) as f:
            out[math.inf if rate == "inf" else float(rate)] = json.load(f)["requests"]
    return out


def highest_rate_within(requests: dict[float, list[dict]], ttft_ms: float, tpot_ms: float,
                        attainment: float = 0.9) -> Optional[float]:
    """The highest rate at which >= attainment of the requests succeeded within both SLOs."""
    def met(r: dict) -> bool:
        tpot = r.get("tpot_s") or 0.0  # one-token answers have no TPOT
        return r["success"] and r["ttft_s"] * 1e3 <= ttft_ms and tpot * 1e3 <= tpot_ms

    ok = [rate for rate, reqs in requests.items() if reqs and sum(map(met, reqs)) >= attainment * len(reqs)]
    return max(ok, default=None)


def slo_table(results: dict[str, dict[str, dict]], mix: str, ttft_ms: float, tpot_slos: list[float]) -> str:
    """How the answer depends on the SLO: the highest sustained rate per TPOT SLO,
    recomputed from the per-request records of the same runs."""
    names = [n for n in results if results[n].get(mix, {}).get("requests")]
    lines = ["| TPOT SLO (ms) | " + " | ".join(f"{n}: highest rate (req/s)" for n in names) + " |",
             "| ---: |" + " ---: |" * len(names)]
    for tpot in tpot_slos:
        cells = []
        for n in names:
            rate = highest_rate_within(results[n][mix]["requests"], ttft_ms, tpot)
            cells.append("none" if rate is None else f"{rate:g}")
        lines.append(f"| {tpot:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def mix_table(results: dict[str, dict[str, dict]], mix: str) -> str:
    names = [n for n in results if mix in results[n]]
    points = {(n, p["rate"]): p["summary"] for n in names for p in results[n][mix]["sweep"]["points"]}
    rates = sorted({r for _, r in points}, key=float)
    head = ["rate (req/s)"] + [f"{n}: {col}" for n in names
                               for col in ("goodput (req/s)", "SLO met", "p90 TTFT (ms)", "p90 TPOT (ms)")]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for rate in rates:
        row = [f"{float(rate):g}"]
        for n in names:
            s = points.get((n, rate))
            if s is None:
                row += ["not run"] * 4
                continue
            row += [_fmt(s["goodput"]), _fmt(s["slo_attainment"] and 100 * s["slo_attainment"], 0) + "%",
                    _fmt(s["ttft_ms"]["p90"], 0), _fmt(s["tpot_ms"]["p90"], 1)]
        lines.append("| " + " | ".join(row) + " |")
    sustained = {n: next(t["max_sustained_rate"] for t in results[n][mix]["sweep"]["targets"]) for n in names}
    lines.append("")
    lines.append("Highest rate with >= 90% of requests within the SLOs: " + "; ".join(
        f"{n} {'none' if r is None else f'{r:g} req/s'}" for n, r in sustained.items()) + ".")
    return "\n".join(lines)


def transfer_stats(metrics: str) -> dict[str, float]:
    """Sums over engines of the KV transfer counters and prompt tokens by source."""
    out: dict[str, float] = {}
    pattern = re.compile(r'^tandem:(kv_transfer_bytes_total|kv_transfer_seconds_sum|kv_transfer_seconds_count|'
                         r'prompt_tokens_by_source_total)\{([^}]*)\} (\S+)$')
    for line in metrics.splitlines():
        m = pattern.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        key = m.group(1) + "/" + labels.get("direction", labels.get("source", "")) + "/" + labels.get("role", "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def transfer_table(results: dict[str, dict[str, dict]]) -> str:
    lines = ["| deployment | mix | direction | transfers | GiB | seconds per transfer | GB/s |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for name, mixes in results.items():
        previous: dict[str, float] = {}
        for mix in MIXES:  # counters accumulate over the run: subtract the mix before
            if mix not in mixes:
                continue
            total = transfer_stats(mixes[mix]["metrics"])
            stats = {k: v - previous.get(k, 0.0) for k, v in total.items()}
            previous = total
            for direction, role in (("save", "prefill"), ("load", "decode")):
                n = stats.get(f"kv_transfer_seconds_count/{direction}/{role}", 0.0)
                if not n:
                    continue
                num_bytes = stats.get(f"kv_transfer_bytes_total/{direction}/{role}", 0.0)
                seconds = stats.get(f"kv_transfer_seconds_sum/{direction}/{role}", 0.0)
                lines.append(f"| {name} | {mix} | {direction} ({role}) | {n:.0f} | {num_bytes / 2**30:.1f} | "
                             f"{seconds / n:.3f} | {num_bytes / max(seconds, 1e-9) / 1e9:.2f} |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict]], mix: str, path: str) -> str:
    from tandem.bench import plots

    def stats(d: dict) -> SimpleNamespace:
        return SimpleNamespace(**d)

    points = []
    for name, mixes in results.items():
        for p in mixes.get(mix, {}).get("sweep", {}).get("points", []):
            s = p["summary"]
            summary = SimpleNamespace(goodput=s["goodput"], request_throughput=s["request_throughput"],
                                      ttft_ms=stats(s["ttft_ms"]), tpot_ms=stats(s["tpot_ms"]),
                                      slos_ms=s["slos_ms"])
            rate = math.inf if p["rate"] == "inf" else float(p["rate"])
            points.append(SimpleNamespace(target=name, rate=rate, summary=summary))
    return plots.sweep(points, path)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.disagg_report", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="deployment tarballs (NAME.tgz) or folders from gpu_disagg.sh")
    p.add_argument("--plots", default=None, help="folder for PREFIX_MIX.png")
    p.add_argument("--prefix", default="disagg")
    p.add_argument("--tpot-slos", default="",
                   help="comma-separated TPOT SLOs in ms: also print, per mix, the highest rate each "
                        "deployment sustained under each of them (TTFT SLO: --ttft-slo)")
    p.add_argument("--ttft-slo", type=float, default=1000.0, help="TTFT SLO in ms for --tpot-slos")
    args = p.parse_args(argv)
    results = load(args.results)
    if not results:
        print("error: no NAME/MIX/sweep.json in " + ", ".join(args.results), file=sys.stderr)
        return 2
    for mix in MIXES:
        if any(mix in m for m in results.values()):
            print(f"### {mix}\n\n{mix_table(results, mix)}\n")
            if args.tpot_slos:
                slos = [float(x) for x in args.tpot_slos.split(",") if x.strip()]
                print(f"TTFT <= {args.ttft_slo:g} ms and:\n\n{slo_table(results, mix, args.ttft_slo, slos)}\n")
            if args.plots:
                os.makedirs(args.plots, exist_ok=True)
                print(f"plot: {plot(results, mix, os.path.join(args.plots, f'{args.prefix}_{mix}.png'))}\n")
    print("### KV transfers\n\n" + transfer_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
