"""Overload (429), SIGTERM drain (exit 0, no child left) and a dead engine core (health 503,
errors to requests in flight, exit non-zero). `drain_server` and `small_server` (one running
seat, one waiting seat) end inside these tests."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from serve_helpers import MODEL_NAME, ServerHandle, pid_alive, sse_events, wait_idle

CMPL = "/v1/completions"


def _open_stream(server: ServerHandle, client: httpx.Client, max_tokens: int):
    """Start a streamed greedy completion and read its first event; returns (context, line iterator)."""
    context = client.stream("POST", CMPL, json={"model": MODEL_NAME, "prompt": "lifecycle", "stream": True,
                                                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    response = context.__enter__()
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            break
    return context, lines


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_overload_gets_429(small_server):
    small = small_server
    with small.client() as a_client, small.client() as c:
        context, _ = _open_stream(small, a_client, max_tokens=1800)  # running: the only seat
        waiting: dict = {}

        def second() -> None:
            with small.client() as b_client:
                waiting["response"] = b_client.post(CMPL, json={"model": MODEL_NAME, "prompt": "b", "max_tokens": 2})

        thread = threading.Thread(target=second)
        thread.start()
        try:
            _wait_for(lambda: small.stats()["num_waiting"] == 1, 30, "the second request to wait")
            r = c.post(CMPL, json={"model": MODEL_NAME, "prompt": "c", "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            r = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "c"}]})
            assert r.status_code == 429, r.text
        finally:
            context.__exit__(None, None, None)  # disconnect: the running request is aborted
            thread.join(60)
        assert waiting["response"].status_code == 200
    wait_idle(small)


@pytest.mark.serial
def test_engine_core_kill_9(small_server):
    small = small_server
    with small.client() as a_client:
        context, lines = _open_stream(small, a_client, max_tokens=1800)
        try:
            os.kill(small.engine_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            _wait_for(lambda: httpx.get(small.url("/health"), timeout=2.0).status_code == 503, 2.0,
                      "/health to turn 503")
            assert time.monotonic() - killed_at < 2.0
            events = sse_events(lines)
        finally:
            context.__exit__(None, None, None)
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and events[-2]["error"]["code"] == "engine_dead", events[-2]
    r = httpx.post(small.url(CMPL), headers=small.headers, json={"model": MODEL_NAME, "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"]
    small.proc.wait(30)
    assert small.proc.returncode not in (0, None), small.log()[-3000:]
    assert not pid_alive(small.engine_pid)


def test_sigterm_drains_then_exits_0(drain_server):
    drain = drain_server
    with drain.client() as a_client, drain.client() as c:
        context, lines = _open_stream(drain, a_client, max_tokens=400)
        try:
            drain.proc.send_signal(signal.SIGTERM)
            _wait_for(lambda: c.get("/v1/models").status_code == 503, 10, "new requests to get 503")
            r = c.post(CMPL, json={"model": MODEL_NAME, "prompt": "late", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
            assert httpx.get(drain.url("/health")).status_code == 503
            events = sse_events(lines)  # the request in flight runs to its end
        finally:
            context.__exit__(None, None, None)
    assert events[-1] == "[DONE]"
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    assert drain.proc.wait(60) == 0, drain.log()[-3000:]
    assert "draining (new requests get 503; 1 in flight" in drain.log()
    assert not pid_alive(drain.engine_pid)
