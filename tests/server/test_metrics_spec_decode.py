"""Speculative-decoding counters on /metrics (vLLM's names, kvtide: prefix), and `bench serve` reading them.

One `kvtide serve --speculative-config` on the demo-like tiny Llama (seed 1234, peaked logits: greedy
output repeats itself, so n-gram drafts get accepted), started for this module and always stopped.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import MODEL_NAME, launch_server, wait_idle

from kvtide.engine.messages import SchedulerStats
from kvtide.server.metrics import ServerMetrics

K = 3
SPEC_CONFIG = json.dumps({"method": "ngram", "num_speculative_tokens": K})
FAMILIES = ("kvtide:spec_decode_num_drafts", "kvtide:spec_decode_num_draft_tokens",
            "kvtide:spec_decode_num_accepted_tokens", "kvtide:spec_decode_num_accepted_tokens_per_pos")


def spec_counters(text: str) -> dict:
    """The four families of a Prometheus text -> {family: value} and per_pos {position: value}."""
    out: dict = {"per_pos": {}}
    for family in text_string_to_metric_families(text):
        if family.name not in FAMILIES:
            continue
        out.setdefault(family.name, 0.0)
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if "position" in sample.labels:
                out["per_pos"][int(sample.labels["position"])] = sample.value
            out[family.name] += sample.value
    return out


@pytest.fixture(scope="module")
def spec_server(checkpoint_factory):
    model = checkpoint_factory("LlamaForCausalLM", seed=1234, initializer_range=0.1)
    handle = launch_server(model, "--speculative-config", SPEC_CONFIG, "--max-num-seqs", "4", api_key=None)
    try:
        yield handle
    finally:
        handle.stop()
        os.unlink(handle.log_path)


def test_update_from_engine_counts_deltas_and_survives_no_speculation():
    metrics = ServerMetrics("m")
    metrics.update_from_engine(SchedulerStats(spec_decoding=None))
    text = metrics.render().decode()
    assert all(f"# TYPE {name}_total counter" in text for name in FAMILIES)
    assert 'kvtide:spec_decode_num_drafts_total{model_name="m"} 0.0' in text
    assert "position=" not in text  # no per-position samples without speculation
    first = {"num_drafts": 4, "num_draft_tokens": 10, "num_accepted_tokens": 5, "accepted_per_pos": [3, 2, 0]}
    second = {"num_drafts": 6, "num_draft_tokens": 15, "num_accepted_tokens": 9, "accepted_per_pos": [5, 3, 1]}
    for counters in (first, first, second, None):  # the same snapshot twice adds nothing; None keeps the counts
        metrics.update_from_engine(SchedulerStats(spec_decoding=counters))
    got = spec_counters(metrics.render().decode())
    assert got["kvtide:spec_decode_num_drafts"] == 6 and got["kvtide:spec_decode_num_draft_tokens"] == 15
    assert got["kvtide:spec_decode_num_accepted_tokens"] == 9 and got["per_pos"] == {0: 5, 1: 3, 2: 1}


def test_spec_decode_metrics_after_requests(spec_server):
    body = {"model": MODEL_NAME, "prompt": "ab ab ab ab ab ab ab ab ab ab", "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}
    with spec_server.client() as c:
        for _ in range(3):
            assert c.post("/v1/completions", json=body).status_code == 200
        wait_idle(spec_server)
        text = c.get("/metrics").text
    for name in FAMILIES:
        assert f"# TYPE {name}_total counter" in text, name
    got = spec_counters(text)
    drafts = got["kvtide:spec_decode_num_drafts"]
    draft_tokens = got["kvtide:spec_decode_num_draft_tokens"]
    accepted = got["kvtide:spec_decode_num_accepted_tokens"]
    per_pos = [got["per_pos"][i] for i in range(K)]
    assert sorted(got["per_pos"]) == list(range(K))
    assert drafts > 0 and drafts <= draft_tokens <= K * drafts
    assert accepted <= draft_tokens and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip([drafts, *per_pos], per_pos, strict=False))  # position i+1 needs i
    # The engine core's own counters, unchanged since the scrape (the engine is idle).
    stats = spec_server.stats()["spec_decoding"]
    assert (stats["num_drafts"], stats["num_draft_tokens"], stats["num_accepted_tokens"]) == (
        drafts, draft_tokens, accepted)
    assert stats["accepted_per_pos"] == per_pos


def test_bench_serve_reports_spec_decode_from_metrics(spec_server, checkpoint_factory, tmp_path, capsys):
    from kvtide.cli import main as kvtide_main

    model = checkpoint_factory("LlamaForCausalLM", seed=1234, initializer_range=0.1)
    before = spec_server.stats()["spec_decoding"]
    out = tmp_path / "serve.json"
    rc = kvtide_main(["bench", "serve", "--base-url", spec_server.base_url, "--tokenizer", model,
                      "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "24",
                      "--num-prompts", "3", "--max-concurrency", "1", "--disable-tqdm", "--output-json", str(out)])
    assert rc == 0
    after = spec_server.stats()["spec_decoding"]
    spec = json.loads(out.read_text())["spec_decode"]
    assert spec is not None and spec["num_speculative_tokens"] == K
    # The warm-up request falls between `before` and the bench's own first scrape.
    assert 0 < spec["num_drafts"] <= after["num_drafts"] - before["num_drafts"]
    assert sum(spec["accepted_per_pos"]) == spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    a = spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(a)
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert spec["theoretical_tokens_per_step"] == pytest.approx((1 - a ** (K + 1)) / (1 - a))
    printed = capsys.readouterr().out
    assert "Speculative Decoding (server)" in printed and "Mean accepted length:" in printed
    assert httpx.get(spec_server.url("/health")).status_code == 200
