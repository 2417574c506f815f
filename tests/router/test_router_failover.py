"""Backends that die or drain lose no request: a SIGKILLed backend is ejected at the first
connection error and the request is retried on another; a draining one (SIGTERM: 503 for new
requests while those in flight finish) has its new requests retried elsewhere."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from router_helpers import MODEL_NAME, kill_server, metric_value, start_router

BODY = {"model": MODEL_NAME, "prompt": "failover", "max_tokens": 8, "temperature": 0.0}


@pytest.mark.slow
def test_killed_backend_is_ejected_and_the_request_retried(victim_kill, backend_a):
    # A long health interval: the request, not the health loop, must find the dead backend.
    router = start_router("--backends", f"{victim_kill.base_url},{backend_a.base_url}", "--policy", "round_robin",
                          "--health-check-interval", "60")
    try:
        assert httpx.get(router.url("/health"), timeout=10.0).json()["healthy_backends"] == 2
        kill_server(victim_kill)
        for _ in range(2):  # round robin: one of the two goes to the dead backend first
            r = httpx.post(router.url("/v1/completions"), json=BODY, timeout=60.0)
            assert r.status_code == 200, r.text
        metrics = router.metrics()
        assert metric_value(metrics, "kvtide_router_retries_total", reason="connection_error") == 1
        assert metric_value(metrics, "kvtide_router_backend_healthy", backend=victim_kill.base_url) == 0
        assert metric_value(metrics, "kvtide_router_backend_healthy", backend=backend_a.base_url) == 1
        assert metric_value(metrics, "kvtide_router_requests_total", backend=backend_a.base_url, status="200") == 2
        health = httpx.get(router.url("/health"), timeout=10.0)
        assert health.status_code == 200 and health.json()["healthy_backends"] == 1
        # Ejected: later requests do not try it again (no new retry).
        r = httpx.post(router.url("/v1/completions"), json=BODY, timeout=60.0)
        assert r.status_code == 200
        assert metric_value(router.metrics(), "kvtide_router_retries_total") == 1
    finally:
        router.stop()


@pytest.mark.slow
def test_draining_backend_loses_no_request(victim_drain, backend_b):
    router = start_router("--backends", f"{victim_drain.base_url},{backend_b.base_url}", "--policy", "round_robin",
                          "--health-check-interval", "0.5")
    statuses: list[int] = []
    lock = threading.Lock()

    def send(max_tokens: int) -> None:
        body = {**BODY, "max_tokens": max_tokens, "ignore_eos": True}
        try:
            status = httpx.post(router.url("/v1/completions"), json=body, timeout=120.0).status_code
        except httpx.HTTPError as e:
            status = -1
            print("request failed:", repr(e))
        with lock:
            statuses.append(status)

    try:
        # Long requests in flight on both backends, then SIGTERM one, and more requests come in.
        in_flight = [threading.Thread(target=send, args=(300,)) for _ in range(4)]
        for t in in_flight:
            t.start()
        deadline = time.monotonic() + 30
        while victim_drain.stats()["num_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert victim_drain.stats()["num_running"] > 0
        victim_drain.proc.send_signal(signal.SIGTERM)
        arriving = []
        for _ in range(8):
            t = threading.Thread(target=send, args=(16,))
            t.start()
            arriving.append(t)
            time.sleep(0.1)
        for t in in_flight + arriving:
            t.join(120)
        assert statuses == [200] * 12, statuses
        assert victim_drain.proc.wait(60) == 0
        assert "draining" in victim_drain.log()
        assert httpx.get(router.url("/health"), timeout=10.0).status_code == 200
    finally:
        router.stop()
