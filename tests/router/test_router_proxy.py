"""The router relays what backends answer: greedy outputs equal a direct backend's (streamed and
not), X-Request-Id and Authorization reach the backend, --api-key guards the router, a client
that goes away mid-stream aborts the backend's request, and /health follows the backends."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from echo_backend import EchoBackend
from router_helpers import MODEL_NAME, free_port, metric_value, sse_events, start_router, wait_idle

COMPLETION = {"model": MODEL_NAME, "prompt": "The router sends this prompt to one backend", "max_tokens": 12,
              "temperature": 0.0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello through the router"}],
        "max_tokens": 10, "temperature": 0.0}


@pytest.fixture(scope="module")
def rr_router(backend_a, backend_b):
    router = start_router("--backends", f"{backend_a.base_url},{backend_b.base_url}", "--policy", "round_robin")
    try:
        yield router
    finally:
        router.stop()


def _stream_text(url: str, body: dict, key: str) -> str:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60.0) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    return "".join(e["choices"][0][key] if key == "text" else e["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if e["choices"])


def test_greedy_completions_equal_a_direct_backend(rr_router, backend_a):
    direct = httpx.post(backend_a.url("/v1/completions"), json=COMPLETION, timeout=60.0)
    assert direct.status_code == 200, direct.text
    expected = direct.json()["choices"][0]["text"]
    # Round robin: two requests reach both backends.
    for _ in range(2):
        routed = httpx.post(rr_router.url("/v1/completions"), json=COMPLETION, timeout=60.0)
        assert routed.status_code == 200, routed.text
        assert routed.json()["choices"][0]["text"] == expected
        assert _stream_text(rr_router.url("/v1/completions"), COMPLETION, "text") == expected


def test_greedy_chat_equals_a_direct_backend(rr_router, backend_b):
    direct = httpx.post(backend_b.url("/v1/chat/completions"), json=CHAT, timeout=60.0)
    assert direct.status_code == 200, direct.text
    expected = direct.json()["choices"][0]["message"]["content"]
    for _ in range(2):
        routed = httpx.post(rr_router.url("/v1/chat/completions"), json=CHAT, timeout=60.0)
        assert routed.json()["choices"][0]["message"]["content"] == expected
        assert _stream_text(rr_router.url("/v1/chat/completions"), CHAT, "content") == expected


def test_round_robin_spreads_and_counts(rr_router, backend_a, backend_b):
    before = rr_router.metrics()
    for _ in range(4):
        assert httpx.post(rr_router.url("/v1/completions"), json=COMPLETION, timeout=60.0).status_code == 200
    after = rr_router.metrics()
    for backend in (backend_a, backend_b):
        name, labels = "kvtide_router_requests_total", {"backend": backend.base_url, "status": "200"}
        assert metric_value(after, name, **labels) - metric_value(before, name, **labels) == 2


def test_backend_errors_pass_through(rr_router):
    bad = httpx.post(rr_router.url("/v1/completions"), json={**COMPLETION, "max_tokens": -1}, timeout=60.0)
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    not_json = httpx.post(rr_router.url("/v1/completions"), content=b"{nope", timeout=60.0,
                          headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "error" in not_json.json()


def test_models_health_and_request_id(rr_router):
    models = httpx.get(rr_router.url("/v1/models"), timeout=30.0)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL_NAME
    assert httpx.get(rr_router.url("/health"), timeout=10.0).status_code == 200
    given = httpx.post(rr_router.url("/v1/completions"), json=COMPLETION, headers={"X-Request-Id": "client-42"},
                       timeout=60.0)
    assert given.headers["x-request-id"] == "client-42"
    made = httpx.post(rr_router.url("/v1/completions"), json=COMPLETION, timeout=60.0)
    assert made.headers["x-request-id"].startswith("rtr-")


def test_request_id_and_authorization_reach_the_backend():
    with EchoBackend(free_port()) as echo:
        router = start_router("--backends", echo.base_url, "--policy", "round_robin")
        try:
            r = httpx.post(router.url("/v1/completions"), json={"model": "m", "prompt": "p"},
                           headers={"X-Request-Id": "abc-1", "Authorization": "Bearer client-key"}, timeout=30.0)
            assert r.status_code == 200 and r.headers["x-request-id"] == "abc-1"
            seen = r.json()["received_headers"]
            assert seen["x-request-id"] == "abc-1" and seen["authorization"] == "Bearer client-key"
            r = httpx.post(router.url("/v1/completions"), json={"model": "m", "prompt": "p"}, timeout=30.0)
            assert r.json()["received_headers"]["x-request-id"] == r.headers["x-request-id"]
            assert r.headers["x-request-id"].startswith("rtr-")
        finally:
            router.stop()
        router = start_router("--backends", echo.base_url, "--backend-api-key", "backend-key", "--api-key", "rk")
        try:
            r = httpx.post(router.url("/v1/completions"), json={"model": "m", "prompt": "p"},
                           headers={"Authorization": "Bearer rk"}, timeout=30.0)
            assert r.json()["received_headers"]["authorization"] == "Bearer backend-key"
            assert "rk" not in router.log() and "backend-key" not in router.log()
        finally:
            router.stop()


def test_api_key_guards_every_route_but_health(backend_a):
    router = start_router("--backends", backend_a.base_url, "--api-key", "router-secret")
    try:
        missing = httpx.post(router.url("/v1/completions"), json=COMPLETION, timeout=30.0)
        assert missing.status_code == 401
        assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
        wrong = httpx.get(router.url("/v1/models"), headers={"Authorization": "Bearer nope"}, timeout=30.0)
        assert wrong.status_code == 401
        assert httpx.get(router.url("/metrics"), timeout=30.0).status_code == 401
        assert httpx.get(router.url("/health"), timeout=30.0).status_code == 200
        for headers in ({"Authorization": "Bearer router-secret"}, {"x-api-key": "router-secret"}):
            assert httpx.post(router.url("/v1/completions"), json=COMPLETION, headers=headers,
                              timeout=60.0).status_code == 200
    finally:
        router.stop()


def test_client_gone_aborts_the_backend_request(backend_a):
    router = start_router("--backends", backend_a.base_url, "--policy", "least_load")
    try:
        aborted_before = backend_a.log().count("finished (abort)")
        body = {**COMPLETION, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", router.url("/v1/completions"), json=body, timeout=60.0) as response:
            assert response.status_code == 200
            next(response.iter_raw())  # the first chunk came: the backend is generating
        wait_idle(backend_a)
        assert backend_a.log().count("finished (abort)") == aborted_before + 1  # not 400 tokens later
        # Not streamed: the router notices the client left while it waits, and cancels the call.
        payload = json.dumps({**body, "stream": False}).encode()
        with socket.create_connection(("127.0.0.1", router.port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            deadline = time.monotonic() + 30
            while backend_a.stats()["num_running"] == 0:  # then the client goes away
                assert time.monotonic() < deadline
                time.sleep(0.02)
        wait_idle(backend_a)
        assert backend_a.log().count("finished (abort)") == aborted_before + 2
        in_flight = metric_value(router.metrics(), "kvtide_router_in_flight_requests", backend=backend_a.base_url)
        assert in_flight == 0
    finally:
        router.stop()


def test_health_503_when_no_backend_is_up():
    dead = f"http://127.0.0.1:{free_port()}"
    router = start_router("--backends", dead, "--health-check-interval", "0.2")
    try:
        health = httpx.get(router.url("/health"), timeout=10.0)
        assert health.status_code == 503 and health.json()["error"]["code"] == "no_healthy_backend"
        r = httpx.post(router.url("/v1/completions"), json=COMPLETION, timeout=30.0)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert metric_value(router.metrics(), "kvtide_router_backend_healthy", backend=dead) == 0
    finally:
        router.stop()
