"""The metric definitions on synthetic timestamps with known answers."""

from __future__ import annotations

import math

import pytest

from kvtide.bench.arrivals import arrival_offsets
from kvtide.bench.client import parse_prometheus, server_counter_deltas
from kvtide.bench.metrics import (
    RequestRecord,
    compute_serving_metrics,
    format_report,
    in_flight_over_time,
    parse_goodput,
    parse_percentiles,
    summarize,
    throughput_over_time,
)


def record(start: float, ttft: float, itl: float, n: int, ok: bool = True, prompt_len: int = 10) -> RequestRecord:
    """n tokens: the first at start+ttft, then one every itl seconds."""
    times = [start + ttft + i * itl for i in range(n)]
    return RequestRecord(prompt_len=prompt_len, expected_output_len=n, start_time=start, chunk_times=times,
                         end_time=times[-1] if times else start, output_len=n, success=ok,
                         error="" if ok else "http 500: boom")


def test_record_definitions():
    r = record(start=10.0, ttft=0.2, itl=0.05, n=5)
    assert r.ttft == pytest.approx(0.2)
    assert r.itls == pytest.approx([0.05] * 4)
    assert r.e2el == pytest.approx(0.4)
    assert r.tpot == pytest.approx(0.05)  # (E2E - TTFT) / (n - 1)
    assert record(0.0, 0.1, 0.0, 1).tpot is None  # one token: no TPOT


def test_percentiles_known_values():
    # 0, 1, ..., 100 ms: percentile p is p ms with linear interpolation.
    s = summarize([i / 1000 for i in range(101)], (50, 90, 99, 99.9))
    assert s["mean"] == pytest.approx(50.0)
    assert s["median"] == pytest.approx(50.0)
    assert s["p90"] == pytest.approx(90.0)
    assert s["p99"] == pytest.approx(99.0)
    assert s["p99.9"] == pytest.approx(99.9)
    # Interpolation between order statistics: [10, 20] ms -> p90 = 19 ms.
    assert summarize([0.010, 0.020], (90,))["p90"] == pytest.approx(19.0)
    assert math.isnan(summarize([], (90,))["p90"])


def test_serving_metrics_exclude_failures_and_compute_goodput():
    ok = [record(start=i * 0.1, ttft=(i + 1) / 1000, itl=0.01 * (1 + i % 2), n=11) for i in range(100)]
    bad = [record(start=0.0, ttft=0.0001, itl=0.0001, n=3, ok=False) for _ in range(7)]
    result = compute_serving_metrics(ok + bad, duration_s=20.0, percentiles=(50, 90, 99, 99.9),
                                     slos_ms={"ttft": 50.0, "tpot": 15.0})
    assert result["completed"] == 100 and result["failed"] == 7
    assert result["errors"] == {"http 500": 7}
    assert result["total_output_tokens"] == 1100 and result["total_input_tokens"] == 1000
    assert result["request_throughput"] == pytest.approx(5.0)
    assert result["output_throughput"] == pytest.approx(55.0)
    assert result["total_token_throughput"] == pytest.approx(105.0)
    # TTFT 1..100 ms over the successful requests only (the failed ones were "faster").
    assert result["mean_ttft_ms"] == pytest.approx(50.5)
    assert result["p90_ttft_ms"] == pytest.approx(90.1)
    assert result["median_tpot_ms"] == pytest.approx(15.0)
    assert result["median_itl_ms"] == pytest.approx(15.0)
    assert result["p99_itl_ms"] == pytest.approx(20.0)
    # Good: TTFT <= 50 ms (i < 50) and TPOT <= 15 ms (even i): 25 requests.
    assert result["good_requests"] == 25
    assert result["request_goodput"] == pytest.approx(25 / 20.0)
    text = format_report(result)
    assert "Failed requests:" in text and "P99.9 TTFT (ms):" in text and "goodput" in text


def test_goodput_e2el_and_parsing():
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:1000"]) == {"ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    for bad in (["ttft"], ["foo:1"], ["ttft:abc"], ["ttft:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    records = [record(0.0, 0.01, 0.01, 11), record(0.0, 0.01, 0.2, 11)]  # E2E 110 ms and 2010 ms
    assert compute_serving_metrics(records, 1.0, slos_ms={"e2el": 500.0})["good_requests"] == 1
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("0,101")


def test_time_series():
    records = [record(0.0, 0.5, 1.0, 3), record(1.0, 0.5, 1.0, 2)]  # chunks at .5 1.5 2.5 and 1.5 2.5
    times, rates = throughput_over_time(records, t0=0.0, bin_s=1.0)
    assert times == [0.0, 1.0, 2.0] and rates == [1.0, 2.0, 2.0]
    t, n = in_flight_over_time(records, t0=0.0)
    assert max(n) == 2 and n[-1] == 0


def test_arrival_process():
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    offsets = arrival_offsets(20001, 10.0, 1.0, seed=3)
    assert offsets == arrival_offsets(20001, 10.0, 1.0, seed=3)  # deterministic in the seed
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.1, rel=0.05)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert var / mean**2 == pytest.approx(1.0, rel=0.1)  # Poisson: CV^2 = 1 / burstiness
    bursty = arrival_offsets(20001, 10.0, 0.25, seed=3)
    bg = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    bm = sum(bg) / len(bg)
    assert sum((g - bm) ** 2 for g in bg) / len(bg) / bm**2 == pytest.approx(4.0, rel=0.15)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 1.0, 0)


def test_prometheus_deltas():
    before = parse_prometheus("# TYPE kvtide:prefix_cache_hits counter\nkvtide:prefix_cache_hits_total 10\n"
                              "# TYPE kvtide:prefix_cache_queries counter\nkvtide:prefix_cache_queries_total 40\n"
                              "# TYPE kvtide:num_preemptions counter\nkvtide:num_preemptions_total 1\n")
    after = parse_prometheus("# TYPE kvtide:prefix_cache_hits counter\nkvtide:prefix_cache_hits_total 70\n"
                             "# TYPE kvtide:prefix_cache_queries counter\nkvtide:prefix_cache_queries_total 140\n"
                             "# TYPE kvtide:num_preemptions counter\nkvtide:num_preemptions_total 4\n")
    deltas = server_counter_deltas(before, after)
    assert deltas["prefix_cache_hit_rate"] == pytest.approx(0.6)
    assert deltas["num_preemptions"] == 3
    assert server_counter_deltas(None, None)["prefix_cache_hit_rate"] is None
    assert parse_prometheus("other_metric 1\n") is None
