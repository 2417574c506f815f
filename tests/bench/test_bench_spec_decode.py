"""`kvtide bench latency|throughput --speculative-config`: the speculative-decoding figures of the
measured part, and the /metrics parsing `bench serve` uses for them."""

from __future__ import annotations

import json

import pytest

from kvtide.bench.client import parse_prometheus, server_counter_deltas
from kvtide.bench.spec_figures import (
    counter_difference,
    counters_from_prometheus,
    format_spec_decode,
    spec_decode_figures,
)
from kvtide.cli import main as kvtide_main
from kvtide.engine.messages import SchedulerStats
from kvtide.server.metrics import ServerMetrics

K = 3
SPEC = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": K})]
SMALL_ENGINE = ["--kv-cache-memory", "64MiB", "--max-model-len", "256", "--cpu-weight-prepack", "off"]


def leviathan(a: float, k: float) -> float:
    return k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a)


@pytest.fixture(scope="module")
def peaked_llama(checkpoint_factory) -> str:
    """The demo model's weights (peaked logits: greedy output repeats, so n-gram drafts exist)."""
    return checkpoint_factory("LlamaForCausalLM", seed=1234, initializer_range=0.1)


def check_figures(spec: dict) -> tuple[float, float]:
    """The figures agree with their counters (the offline ones carry the rejection count); returns
    the theory's per-token acceptance and draft length."""
    assert spec["num_speculative_tokens"] == K and spec["num_drafts"] > 0
    assert spec["num_drafts"] <= spec["num_draft_tokens"] <= K * spec["num_drafts"]
    assert len(spec["accepted_per_pos"]) == K
    assert sum(spec["accepted_per_pos"]) == spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    a = spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(a)
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert spec["acceptance_rate_per_pos"] == pytest.approx([n / spec["num_drafts"] for n in spec["accepted_per_pos"]])
    per_token = spec["num_accepted_tokens"] / (spec["num_accepted_tokens"] + spec["num_rejections"])
    mean_k = spec["num_draft_tokens"] / spec["num_drafts"]
    assert spec["num_rejections"] <= spec["num_drafts"]
    assert spec["theory_acceptance"] == pytest.approx(per_token) and per_token >= a
    assert spec["theoretical_tokens_per_step"] == pytest.approx(leviathan(per_token, mean_k))
    return per_token, mean_k


def test_latency_reports_spec_decode(peaked_llama, tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = kvtide_main(["bench", "latency", "--model", peaked_llama, "--input-len", "16", "--output-len", "24",
                      "--num-iters", "2", "--num-iters-warmup", "1", "--output-json", str(out), *SPEC, *SMALL_ENGINE])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["speculative_config"] == {"method": "ngram", "num_speculative_tokens": K}
    spec = result["kvtide"]["spec_decode"]
    a, mean_k = check_figures(spec)
    # Only the measured iterations: 2 requests of 24 tokens verify at most 2 * 23 drafts.
    assert spec["num_drafts"] <= 2 * 23
    printed = capsys.readouterr().out
    assert f"kvtide speculative decoding (K={K}): mean accepted length {spec['mean_accepted_length']:.3f}" in printed
    assert f"(theory for a={a:.3f}, k={mean_k:.2f}: {leviathan(a, mean_k):.3f})" in printed
    assert "acceptance per position: " in printed


def test_throughput_reports_spec_decode(peaked_llama, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    rc = kvtide_main(["bench", "throughput", "--model", peaked_llama, "--num-prompts", "2", "--input-len", "12",
                      "--output-len", "16", "--skip-hf", "--skip-peak", "--output-json", str(out),
                      *SPEC, *SMALL_ENGINE])
    assert rc == 0
    spec = json.loads(out.read_text())["kvtide"]["spec_decode"]
    check_figures(spec)
    assert "kvtide speculative decoding (K=3): mean accepted length" in capsys.readouterr().out


def test_figures_without_drafts_or_speculation():
    assert spec_decode_figures(None, K) is None and format_spec_decode(None) == ""
    idle = spec_decode_figures({"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                                "accepted_per_pos": [0, 0, 0]}, K)
    assert idle["num_drafts"] == 0 and idle["theoretical_tokens_per_step"] is None
    assert format_spec_decode(idle) == "speculative decoding (K=3): no drafts during the measured run"
    every = spec_decode_figures({"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 6,
                                 "accepted_per_pos": [2, 2, 2]}, K)
    assert every["acceptance_rate"] == 1.0 and every["theoretical_tokens_per_step"] == K + 1


def test_counters_from_server_metrics_text():
    metrics = ServerMetrics("m")
    metrics.update_from_engine(SchedulerStats(spec_decoding=None))
    plain = parse_prometheus(metrics.render().decode())
    metrics.update_from_engine(SchedulerStats(spec_decoding={"num_drafts": 2, "num_draft_tokens": 5,
                                                             "num_accepted_tokens": 2, "accepted_per_pos": [2, 0, 0]}))
    before = parse_prometheus(metrics.render().decode())
    metrics.update_from_engine(SchedulerStats(spec_decoding={"num_drafts": 12, "num_draft_tokens": 35,
                                                             "num_accepted_tokens": 14, "accepted_per_pos": [9, 4, 1]}))
    after = parse_prometheus(metrics.render().decode())
    assert counters_from_prometheus(plain) is None  # speculation off: no figures, nothing printed
    assert server_counter_deltas(plain, plain)["spec_decode"] is None
    assert counters_from_prometheus(after) == {"num_drafts": 12, "num_draft_tokens": 35, "num_accepted_tokens": 14,
                                               "accepted_per_pos": [9, 4, 1]}
    assert counter_difference(counters_from_prometheus(after), None) is None  # no baseline, no figures
    spec = server_counter_deltas(before, after)["spec_decode"]
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (10, 30, 12)
    assert spec["accepted_per_pos"] == [7, 4, 1] and spec["num_speculative_tokens"] == 3
    assert spec["theoretical_tokens_per_step"] == pytest.approx(leviathan(0.4, 3))
    assert server_counter_deltas(parse_prometheus("vllm:num_requests_running 0\n"),
                                 parse_prometheus("vllm:num_requests_running 1\n"))["spec_decode"] is None
    # vLLM's own families read the same way.
    vllm = parse_prometheus("\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter", 'vllm:spec_decode_num_drafts_total{engine="0"} 4.0',
        "# TYPE vllm:spec_decode_num_draft_tokens counter", 'vllm:spec_decode_num_draft_tokens_total{engine="0"} 8.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 3.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 1.0', ""]))
    assert counters_from_prometheus(vllm) == {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 3,
                                              "accepted_per_pos": [2, 1]}
