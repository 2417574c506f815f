"""PNG plots of a serving run (matplotlib, the `plots` extra): latency CDFs, throughput and requests
in flight over time. Without matplotlib nothing is drawn and an empty list is returned."""

from __future__ import annotations

import os

import numpy as np

from kvtide.bench.metrics import in_flight_over_time, throughput_over_time
from kvtide.bench.request_record import RequestRecord


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_serving(records: list[RequestRecord], t0: float, running_samples: list[tuple[float, float]],
                 out_dir: str, prefix: str = "serve") -> list[str]:
    """Write {prefix}_latency_cdf.png and {prefix}_timeline.png into out_dir; return their paths."""
    plt = _pyplot()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    ok = [r for r in records if r.success]
    written = []

    series = {
        "TTFT": [r.ttft for r in ok if r.ttft is not None],
        "TPOT": [r.tpot for r in ok if r.tpot is not None],
        "ITL": [g for r in ok for g in r.itls],
        "E2E latency": [r.e2el for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items(), strict=True):
        if values:
            ms = np.sort(np.asarray(values) * 1000.0)
            ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), drawstyle="steps-post")
        ax.set_title(f"{name} CDF ({len(values)} values)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(alpha=0.3)
    fig.suptitle(f"latency CDFs: {len(ok)} ok, {len(records) - len(ok)} failed")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{prefix}_latency_cdf.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    fig, (ax_tp, ax_run) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    span = max((r.end_time - t0 for r in records), default=1.0)
    bin_s = max(0.1, round(span / 40, 1))
    times, rates = throughput_over_time(records, t0, bin_s)
    if times:
        ax_tp.bar(times, rates, width=bin_s, align="edge", alpha=0.7)
    ax_tp.set_ylabel(f"output tokens/s ({bin_s:g} s bins)")
    ax_tp.set_title("throughput over time")
    ax_tp.grid(alpha=0.3)
    t_in, n_in = in_flight_over_time(records, t0)
    if t_in:
        ax_run.step(t_in, n_in, where="post", label="in flight (client)")
    if running_samples:
        ax_run.plot([t for t, _ in running_samples], [v for _, v in running_samples],
                    marker=".", label="running (server /metrics)")
    ax_run.set_xlabel("seconds since start")
    ax_run.set_ylabel("requests")
    ax_run.set_title("requests over time")
    ax_run.legend(loc="upper right")
    ax_run.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{prefix}_timeline.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written
