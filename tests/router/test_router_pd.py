"""Prefill/decode through the router with backends that ignore kv_transfer_params: the prefill
(max_tokens 1) then the decode request yield what a direct request does; with every prefill
backend dead the decode backend computes the prompt itself (a fallback, counted)."""

from __future__ import annotations

import httpx
import pytest
from router_helpers import MODEL_NAME, free_port, metric_value, sse_events, start_router

COMPLETION = {"model": MODEL_NAME, "prompt": "Disaggregated prefill then decode", "max_tokens": 10,
              "temperature": 0.0, "n": 1}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "prefill me"}], "max_completion_tokens": 8,
        "temperature": 0.0, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def pd_router(backend_a, backend_b):
    router = start_router("--prefill", backend_a.base_url, "--decode", backend_b.base_url, "--policy", "least_load")
    try:
        yield router
    finally:
        router.stop()


def _streamed_text(url: str, body: dict) -> str:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60.0) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    return "".join((c.get("text") or (c.get("delta") or {}).get("content") or "")
                   for e in events[:-1] for c in e["choices"])


def test_prefill_then_decode_equals_a_direct_request(pd_router, backend_a, backend_b):
    direct = httpx.post(backend_b.url("/v1/completions"), json=COMPLETION, timeout=60.0).json()
    direct_chat = httpx.post(backend_b.url("/v1/chat/completions"), json={**CHAT, "stream_options": None},
                             timeout=60.0).json()
    before = pd_router.metrics()
    routed = httpx.post(pd_router.url("/v1/completions"), json=COMPLETION, timeout=60.0)
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    assert len(routed.json()["choices"][0]["text"]) > 1  # the decode's, not the 1-token prefill's
    assert _streamed_text(pd_router.url("/v1/completions"), COMPLETION) == direct["choices"][0]["text"]
    chat = httpx.post(pd_router.url("/v1/chat/completions"), json={**CHAT, "stream_options": None}, timeout=60.0)
    assert chat.json()["choices"][0]["message"]["content"] == direct_chat["choices"][0]["message"]["content"]
    assert _streamed_text(pd_router.url("/v1/chat/completions"), CHAT) == \
        direct_chat["choices"][0]["message"]["content"]
    after = pd_router.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("kvtide_router_requests_total", backend=backend_a.base_url, status="200") == 4  # prefills
    assert delta("kvtide_router_requests_total", backend=backend_b.base_url, status="200") == 4  # decodes
    assert delta("kvtide_router_pd_prefill_seconds_count") == 4
    assert delta("kvtide_router_pd_decode_ttft_seconds_count") == 4
    assert delta("kvtide_router_pd_prefill_fallbacks_total") == 0


def test_every_prefill_backend_dead_falls_back_to_decode(backend_b):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    router = start_router("--prefill", ",".join(dead), "--decode", backend_b.base_url,
                          "--health-check-interval", "60")
    try:
        direct = httpx.post(backend_b.url("/v1/completions"), json=COMPLETION, timeout=60.0).json()
        routed = httpx.post(router.url("/v1/completions"), json=COMPLETION, timeout=60.0)
        assert routed.status_code == 200, routed.text
        assert routed.json()["choices"][0]["text"] == direct["choices"][0]["text"]
        assert _streamed_text(router.url("/v1/completions"), COMPLETION) == direct["choices"][0]["text"]
        assert httpx.get(router.url("/health"), timeout=10.0).status_code == 200
        assert metric_value(router.metrics(), "kvtide_router_pd_prefill_fallbacks_total") == 2
    finally:
        router.stop()
