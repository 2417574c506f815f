"""Serving metrics from per-request timestamps: the definitions every `kvtide bench` figure uses.

One request, as the client sees it (times relative to when it was sent):

    sent          first token        token 2   token 3 ...          last token / [DONE]
     |<---- TTFT ---->|<--- ITL --->|<- ITL ->|        ...          |
     |<------------------------------- E2E latency ----------------->|
                      TPOT = (E2E - TTFT) / (output_tokens - 1)

- TTFT: time to the first streamed chunk that carries a token (text, or an empty chunk before the end).
- ITL: the gap between successive token-carrying chunks (one value per gap, pooled over requests).
- TPOT: per request, mean time per output token after the first; requests with one token have none.
- E2E: send to end of stream.
Throughputs divide by the benchmark's wall time (first send to last completion). Goodput counts only
the successful requests that meet every given SLO. Failed requests (HTTP errors, dropped streams, no
[DONE], no tokens) are counted as failed and kept out of every latency figure.
"""

from __future__ import annotations

import math

import numpy as np

from kvtide.bench.request_record import RequestRecord
from kvtide.bench.structured_figures import report_rows

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0, 99.9)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: expected KEY:MS with KEY in {'/'.join(GOODPUT_KEYS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput: {item!r}: the SLO must be > 0 ms")
        slos[key] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    """'50,90,99,99.9' -> [50.0, 90.0, 99.0, 99.9]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles: expected numbers like 50,90,99; got {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles: each value must be in (0, 100], got {text!r}")
    return values


def percentile_key(p: float) -> str:
    """90.0 -> 'p90', 99.9 -> 'p99.9'."""
    return f"p{p:g}"


def summarize(values_s: list[float], percentiles: tuple[float, ...] | list[float] = DEFAULT_PERCENTILES
              ) -> dict[str, float]:
    """Mean, median, std and percentiles of `values_s` (seconds), reported in milliseconds.

    Percentiles interpolate linearly between order statistics (numpy's default), as vLLM does."""
    if not values_s:
        out = {"mean": math.nan, "median": math.nan, "std": math.nan}
        out.update({percentile_key(p): math.nan for p in percentiles})
        return out
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(ms, p))
    return out


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    if not record.success:
        return False
    for key, limit_ms in slos_ms.items():
        value = record.e2el if key == "e2el" else getattr(record, key)
        if value is None:
            if key == "tpot":  # one output token: there is no time per output token to violate
                continue
            return False
        if value * 1000.0 > limit_ms:
            return False
    return True


def compute_serving_metrics(records: list[RequestRecord], duration_s: float,
                            percentiles: tuple[float, ...] | list[float] = DEFAULT_PERCENTILES,
                            slos_ms: dict[str, float] | None = None) -> dict:
    """The summary `kvtide bench serve` prints and writes. Latencies in ms, throughputs per second."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    result: dict = {
        "duration_s": duration_s,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        # Successful requests that ended before max_tokens: a server that ignored ignore_eos shows here.
        # Constrained ones end where their grammar does and are left out.
        "num_short_outputs": sum(r.output_len < r.expected_output_len for r in ok if r.structured_outputs is None),
    }
    series = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itls],
        "e2el": [r.e2el for r in ok],
    }
    for name in LATENCY_METRICS:
        for stat, value in summarize(series[name], percentiles).items():
            result[f"{stat}_{name}_ms"] = value
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in ok)
        result["goodput_slos_ms"] = dict(slos_ms)
        result["good_requests"] = good
        result["request_goodput"] = good / duration_s
    errors: dict[str, int] = {}
    for r in failed:
        kind = r.error.split(":", 1)[0] or "unknown"
        errors[kind] = errors.get(kind, 0) + 1
    result["errors"] = errors
    return result


def throughput_over_time(records: list[RequestRecord], t0: float, bin_s: float = 1.0
                         ) -> tuple[list[float], list[float]]:
    """Output tokens/s in bins of `bin_s` seconds since t0 (each text chunk counted at arrival,
    scaled so a request's chunks add up to its output tokens)."""
    times: list[float] = []
    weights: list[float] = []
    for r in records:
        if not r.success or not r.chunk_times:
            continue
        per_chunk = r.output_len / len(r.chunk_times)
        times.extend(t - t0 for t in r.chunk_times)
        weights.extend([per_chunk] * len(r.chunk_times))
    if not times:
        return [], []
    num_bins = int(max(times) // bin_s) + 1
    counts = np.zeros(num_bins)
    for t, w in zip(times, weights, strict=True):
        counts[int(t // bin_s)] += w
    return [i * bin_s for i in range(num_bins)], list(counts / bin_s)


def in_flight_over_time(records: list[RequestRecord], t0: float) -> tuple[list[float], list[int]]:
    """Step function of requests in flight (sent, not yet finished) as seen by the client."""
    events: list[tuple[float, int]] = []
    for r in records:
        events.append((r.start_time - t0, 1))
        events.append((r.end_time - t0, -1))
    events.sort()
    times, counts, current = [], [], 0
    for t, delta in events:
        current += delta
        times.append(t)
        counts.append(current)
    return times, counts


def format_report(result: dict, title: str = "Serving Benchmark Result") -> str:
    """vLLM-style text block of the summary."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value, fmt: str = "{:.2f}") -> None:
        text = fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", result["completed"], "{}")
    row("Failed requests:", result["failed"], "{}")
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"], "{}")
    row("Benchmark duration (s):", result["duration_s"])
    row("Total input tokens:", result["total_input_tokens"], "{}")
    row("Total generated tokens:", result["total_output_tokens"], "{}")
    row("Request throughput (req/s):", result["request_throughput"])
    if "request_goodput" in result:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{label:-^60}")
        for key in sorted((k for k in result if k.endswith(f"_{name}_ms") and not k.startswith("std")),
                          key=_stat_order):
            stat = key[: -len(f"_{name}_ms")]
            row(f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {name.upper()} (ms):", result[key])
    if result.get("num_short_outputs"):
        row("Outputs shorter than max_tokens:", result["num_short_outputs"], "{}")
    for key, label in (("prefix_cache_hit_rate", "Prefix cache hit rate:"),
                       ("num_preemptions", "Preemptions (server):")):
        if result.get(key) is not None:
            row(label, result[key], "{:.2%}" if key == "prefix_cache_hit_rate" else "{}")
    spec = result.get("spec_decode")
    if spec:
        lines.append(f"{'Speculative Decoding (server)':-^60}")
        row("Drafts:", spec["num_drafts"], "{}")
        row("Draft tokens:", spec["num_draft_tokens"], "{}")
        row("Accepted tokens:", spec["num_accepted_tokens"], "{}")
        if spec["num_drafts"]:
            row("Acceptance rate (%):", 100 * spec["acceptance_rate"])
            row("Mean accepted length:", spec["mean_accepted_length"], "{:.3f}")
            row(f"Theory (1-a^(K+1))/(1-a), K={spec['num_speculative_tokens']}:",
                spec["theoretical_tokens_per_step"], "{:.3f}")
            for position, rate in enumerate(spec["acceptance_rate_per_pos"]):
                row(f"Acceptance at position {position} (%):", 100 * rate)
    if result.get("structured_output"):
        lines.append(f"{'Structured Output':-^60}")
        for label, value, fmt in report_rows(result["structured_output"]):
            row(label, value, fmt)
    if result.get("errors"):
        lines.append(f"{'Errors':-^60}")
        for kind, count in sorted(result["errors"].items()):
            row(f"{kind}:", count, "{}")
    lines.append("=" * 60)
    return "\n".join(lines)


def _stat_order(key: str) -> tuple[int, float]:
    stat = key.split("_", 1)[0]
    if stat == "mean":
        return (0, 0.0)
    if stat == "median":
        return (1, 0.0)
    try:
        return (2, float(stat[1:]))
    except ValueError:
        return (3, 0.0)
