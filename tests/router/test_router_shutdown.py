"""SIGTERM on a real `kvtide router` in front of a real `kvtide serve` (tests/server covers the
server's own drain): the streams in flight finish whole, new connections are refused (or get
503), and the router exits 0 within its --shutdown-timeout."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from router_helpers import MODEL_NAME, sse_events, start_router

MAX_TOKENS = 480  # the backends' --max-model-len is 512
NUM_STREAMS = 4
SHUTDOWN_TIMEOUT_S = 30.0


def _stream(url: str, prompt: str, first_chunk: threading.Event, out: dict) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    lines = []
    try:
        with httpx.stream("POST", url, json=body, timeout=60.0) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    first_chunk.set()
                lines.append(line)
    except Exception as e:  # reported by the test's assertions
        out["error"] = repr(e)
    finally:
        first_chunk.set()
        out["events"] = sse_events(lines)
        out["done_at"] = time.monotonic()


def test_sigterm_drains_streams_refuses_new_and_exits_zero(backend_a):
    router = start_router("--backends", backend_a.base_url, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    try:
        url = router.url("/v1/completions")
        results = [{} for _ in range(NUM_STREAMS)]
        started = [threading.Event() for _ in range(NUM_STREAMS)]
        threads = [threading.Thread(target=_stream, args=(url, f"drain {i}", started[i], results[i]), daemon=True)
                   for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(30), "no first chunk within 30 s"
        assert all("done_at" not in r for r in results), "a stream ended before SIGTERM: make them longer"

        router.proc.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        time.sleep(0.1)  # the signal handler has run: the listening socket is closed

        # A new request: refused at connect, or a 503 (never served).
        try:
            response = httpx.post(url, json={"model": MODEL_NAME, "prompt": "late", "max_tokens": 2}, timeout=10.0)
            assert response.status_code == 503, response.text
        except httpx.ConnectError:
            pass
        assert any("done_at" not in r for r in results), "every stream ended before the new request was tried"

        for thread in threads:
            thread.join(SHUTDOWN_TIMEOUT_S)
        for r in results:
            assert "error" not in r and r["status"] == 200, r
            events = r["events"]
            assert events[-1] == "[DONE]", events[-3:]
            choices = [e for e in events[:-1] if e.get("choices")]
            assert choices[-1]["choices"][0]["finish_reason"] == "length", choices[-1]
            assert events[-2]["usage"]["completion_tokens"] == MAX_TOKENS, events[-2]

        assert router.proc.wait(SHUTDOWN_TIMEOUT_S) == 0, router.log()[-3000:]
        exited_after = time.monotonic() - signalled_at
        assert exited_after < SHUTDOWN_TIMEOUT_S, exited_after
        assert "draining" in router.log()
    finally:
        router.stop()


def test_sigterm_cuts_streams_after_shutdown_timeout(backend_a):
    """A stream still running at --shutdown-timeout is cut then (0 here: at once, the tiny model's
    streams outrun any longer timeout); the router still exits 0, promptly."""
    router = start_router("--backends", backend_a.base_url, "--shutdown-timeout", "0")
    try:
        results = [{} for _ in range(NUM_STREAMS)]
        started = [threading.Event() for _ in range(NUM_STREAMS)]
        threads = [threading.Thread(target=_stream, args=(router.url("/v1/completions"), f"cut {i}", started[i],
                                                          results[i]), daemon=True) for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(30)
        router.proc.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        assert router.proc.wait(15) == 0, router.log()[-3000:]
        assert time.monotonic() - signalled_at < 10
        for thread in threads:
            thread.join(15)
        assert any("[DONE]" not in r["events"] for r in results), json.dumps(results)[:500]
    finally:
        router.stop()
