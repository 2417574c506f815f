"""Prefill/decode disaggregation with real parts: a kv_producer and a kv_consumer `kvtide serve`
(the p2p connector) behind a real `kvtide router --prefill P --decode D`.

Greedy outputs through the pair equal a direct request's, streamed and not; the decode instance
loads the prompts instead of computing them; a prefill instance killed mid-run costs computation or
errors, never a hang; no KV block is left held on either side."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from router_helpers import (
    MODEL_NAME,
    kill_server,
    metric_value,
    sse_events,
    start_router,
    start_server,
    wait_idle,
    wait_ready,
)

FLAGS = ["--max-num-seqs", "8", "--kv-cache-memory", "8MiB"]
SECRET = {"KVTIDE_KV_SECRET": "pd-test-secret"}


def p2p(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "p2p", "kv_role": role, "kv_transfer_timeout_s": 5})]


@contextlib.contextmanager
def pd_pair(model_dir: str, *router_args: str):
    """A kv_producer and a kv_consumer `kvtide serve` behind `kvtide router --prefill P --decode D`."""
    handles = [start_server(model_dir, *FLAGS, *p2p(role), api_key=None, env=SECRET)
               for role in ("kv_producer", "kv_consumer")]
    router = None
    try:
        producer, consumer = (wait_ready(h) for h in handles)
        router = start_router("--prefill", producer.base_url, "--decode", consumer.base_url, *router_args)
        yield producer, consumer, router
    finally:
        if router is not None:
            router.stop()
        for h in handles:
            h.stop()


@pytest.fixture(scope="module")
def pd(llama_dir):
    with pd_pair(llama_dir, "--health-check-interval", "0.5") as pair:
        yield pair


def requests_mix(n: int) -> list[dict]:
    rng = random.Random(7)
    words = "alpha beta gamma delta kv cache block prefill decode router token stream".split()
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))
        body = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": rng.randint(4, 12), "ignore_eos": True}
        if i % 3 == 2:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        body["stream"] = i % 2 == 1
        out.append(body)
    return out


def send(base_url: str, body: dict, timeout: float = 120.0) -> tuple[int, str]:
    """(status, generated text) of one request, streamed or not."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body["stream"]:
        r = httpx.post(base_url + path, json=body, timeout=timeout)
        if r.status_code != 200:
            return r.status_code, r.text
        choice = r.json()["choices"][0]
        return 200, choice.get("text") if "text" in choice else choice["message"]["content"]
    with httpx.stream("POST", base_url + path, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return 200, "".join((c.get("text") or (c.get("delta") or {}).get("content") or "")
                        for e in events[:-1] if isinstance(e, dict) for c in e["choices"])


def test_pd_pair_outputs_equal_a_single_instance(pd):
    producer, consumer, router = pd
    bodies = requests_mix(50)
    # The reference: each request alone on the decode instance (salted, so it computes the prompt).
    want = [send(consumer.base_url, {**b, "stream": False, "cache_salt": "reference"}) for b in bodies]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda b: send(router.base_url, b), bodies))
    assert got == want
    stats = wait_idle(consumer)
    assert stats["kv_connector"]["hit_tokens"]["p2p"] > 0
    assert stats["kv_connector"]["transfer_failures"] == 0
    assert stats["num_used_blocks"] == 0
    producer_stats = wait_idle(producer)
    assert producer_stats["kv_connector"]["staged_requests"] == 50
    assert producer_stats["num_used_blocks"] == 0
    consumer_metrics = httpx.get(consumer.url("/metrics")).text
    assert metric_value(consumer_metrics, "kvtide:kv_connector_hit_tokens_total", tier="p2p") \
        == stats["kv_connector"]["hit_tokens"]["p2p"]
    assert metric_value(httpx.get(producer.url("/metrics")).text, "kvtide:kv_connector_staged_requests_total") == 50
    text = router.metrics()
    assert metric_value(text, "kvtide_router_pd_prefill_fallbacks_total") == 0
    assert metric_value(text, "kvtide_router_pd_prefill_seconds_count") >= 50


def test_usage_reports_the_transferred_prompt_as_cached(pd):
    _, _, router = pd
    body = {"model": MODEL_NAME, "prompt": "cached tokens through the pair " * 8, "max_tokens": 4,
            "temperature": 0.0}
    r = httpx.post(router.url("/v1/completions"), json=body, timeout=60.0)
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert "kv_transfer_params" not in r.json()  # the producer's handle stays between the router and the pair


def test_killing_the_prefill_instance_mid_run_never_hangs(pd):
    producer, consumer, router = pd
    bodies = requests_mix(16)
    want = [send(consumer.base_url, {**b, "stream": False, "cache_salt": "reference-2"}) for b in bodies]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(send, router.base_url, b) for b in bodies]
        time.sleep(0.5)
        kill_server(producer)
        start = time.monotonic()
        results = [f.result(timeout=120) for f in futures]
    assert time.monotonic() - start < 120
    for (status, text), (_, expected) in zip(results, want, strict=True):
        assert status == 200 and text == expected or status >= 500, (status, text)
    assert sum(status == 200 for status, _ in results) >= len(bodies) // 2
    # With no prefill instance left the router sends requests to the decode instance whole.
    status, text = send(router.base_url, {**bodies[0], "stream": False})
    assert (status, text) == want[0]
    assert metric_value(router.metrics(), "kvtide_router_pd_prefill_fallbacks_total") >= 1
    assert wait_idle(consumer)["num_used_blocks"] == 0


def test_client_gone_in_either_phase_leaks_no_block(pd_alive):
    producer, consumer, router = pd_alive
    body = {"model": MODEL_NAME, "prompt": "abandoned " * 40, "max_tokens": 600, "ignore_eos": True,
            "temperature": 0.0}
    payload = json.dumps(body).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    # Gone at once, during the prefill request, or around the hand-over (the tiny model's prefill
    # takes milliseconds, so the delays spread over both phases) ...
    for delay_s in (0.0, 0.005, 0.02, 0.05, 0.1):
        with socket.create_connection(("127.0.0.1", router.port)) as sock:
            sock.sendall(request)
            time.sleep(delay_s)
    # ... and surely while the decode instance streams: the abort reaches it.
    aborted = metric_value(httpx.get(consumer.url("/metrics")).text, "kvtide:request_success_total",
                           finished_reason="abort")
    with httpx.stream("POST", router.url("/v1/completions"), json={**body, "stream": True}, timeout=60.0) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 30
    while metric_value(httpx.get(consumer.url("/metrics")).text, "kvtide:request_success_total",
                       finished_reason="abort") == aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_value(httpx.get(consumer.url("/metrics")).text, "kvtide:request_success_total",
                        finished_reason="abort") > aborted
    for server in (producer, consumer):
        deadline = time.monotonic() + 30
        while (stats := wait_idle(server))["num_used_blocks"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stats["num_used_blocks"] == 0, stats


@pytest.fixture(scope="module")
def pd_alive(llama_dir):
    """A pair of its own: the module's `pd` loses its prefill instance in the kill test."""
    with pd_pair(llama_dir) as pair:
        yield pair
