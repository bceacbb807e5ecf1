"""PNG plots of benchmark results (matplotlib, headless Agg backend)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # no display needed; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tandem.bench.metrics import RequestRecord  # noqa: E402

if TYPE_CHECKING:
    from tandem.bench.sweep import SweepPoint


def _cdf(ax, seconds: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    if not seconds:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ms = np.sort(np.asarray(seconds) * 1000.0)
    ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
    for q, style in ((50, ":"), (90, "--"), (99, "-.")):
        ax.axvline(np.percentile(ms, q), color="grey", linestyle=style, linewidth=0.8, label=f"p{q}")
    ax.legend(loc="lower right", fontsize="small")


def latency_cdfs(records: list[RequestRecord], path: str) -> str:
    """TTFT, TPOT and E2E CDFs of the completed requests, side by side."""
    ok = [r for r in records if r.success]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _cdf(axes[0], [r.ttft_s for r in ok if r.ttft_s is not None], "time to first token")
    _cdf(axes[1], [t for t in (r.tpot_s for r in ok) if t is not None], "time per output token")
    _cdf(axes[2], [r.e2e_s for r in ok if r.e2e_s is not None], "end-to-end latency")
    fig.suptitle(f"{len(ok)} completed, {len(records) - len(ok)} failed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def timeline(records: list[RequestRecord], path: str) -> str:
    """Streamed chunks per second (~tokens/s) and requests in flight, over the run."""
    ok = [r for r in records if r.success]
    fig, ax = plt.subplots(figsize=(10, 4))
    times = np.asarray([t for r in ok for t in r.token_times_s()])
    end = max([r.end_s for r in records] + [1e-3])
    width = max(end / 60.0, 0.05)  # ~60 bins whatever the run's length
    bins = np.arange(0.0, end + width, width)
    counts, _ = np.histogram(times, bins=bins)
    ax.step(bins[:-1], counts / width, where="post", label="chunks/s (~output tok/s)")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("chunks per second")
    ax.grid(alpha=0.3)
    # Requests in flight: +1 at each send, -1 at each end, as an exact step function.
    events = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    xs, ys, level = [0.0], [0], 0
    for t, delta in events:
        level += delta
        xs.append(t)
        ys.append(level)
    ax2 = ax.twinx()
    ax2.step(xs, ys, where="post", color="tab:orange", label="requests in flight")
    ax2.set_ylabel("requests in flight")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep(points: list["SweepPoint"], path: str) -> str:
    """Goodput (or throughput without SLOs), p90 TTFT and p90 TPOT against the
    request rate, one line per deployment. Rates sit at even spacing so that
    1,2,4,... and inf all fit."""
    rates = sorted({p.rate for p in points})
    x_of = {r: i for i, r in enumerate(rates)}
    has_slos = any(p.summary.goodput is not None for p in points)
    panels = [
        ("goodput (req/s)" if has_slos else "request throughput (req/s)",
         lambda s: s.goodput if has_slos else s.request_throughput),
        ("p90 TTFT (ms)", lambda s: s.ttft_ms.p90),
        ("p90 TPOT (ms)", lambda s: s.tpot_ms.p90),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    targets = list(dict.fromkeys(p.target for p in points))
    for ax, (label, value) in zip(axes, panels):
        for target in targets:
            mine = sorted((p for p in points if p.target == target), key=lambda p: p.rate)
            xs = [x_of[p.rate] for p in mine]
            ys = [value(p.summary) for p in mine]
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=target)
        ax.set_xticks(range(len(rates)), [f"{r:g}" for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    slos = next((p.summary.slos_ms for p in points if p.summary.slos_ms), {})
    if slos:
        fig.suptitle("SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()))
        for ax, key in ((axes[1], "ttft"), (axes[2], "tpot")):
            if key in slos:
                ax.axhline(slos[key], color="red", linestyle="--", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
