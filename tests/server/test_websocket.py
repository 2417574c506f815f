"""/v1/chat/completions and /v1/completions over WebSocket: the SSE stream's payloads, one message each."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from serve_helpers import API_KEY, MODEL_NAME, sse_events, wait_idle
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from kvtide.server.openai.websocket import sse_payloads

CHAT = ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hello"}],
                                 "max_tokens": 12, "temperature": 0, "stream_options": {"include_usage": True}})
COMPLETION = ("/v1/completions", {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12,
                                  "temperature": 0, "logprobs": 1, "stream_options": {"include_usage": True}})


def _ws_url(server, path: str) -> str:
    return server.url(path).replace("http://", "ws://")


def _ws_messages(server, path: str, body: str, key: str | None = API_KEY) -> tuple[list[str], int]:
    """Every message the server sends for `body`, and the close code."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    messages = []
    with connect(_ws_url(server, path), additional_headers=headers, open_timeout=30) as ws:
        if body is not None:
            ws.send(body)
        try:
            while True:
                messages.append(ws.recv(timeout=60))
        except ConnectionClosed as e:
            return messages, e.rcvd.code


def _normalised(event, floats: list[float]):
    """ids, timestamps and prefix-cache hits (the second run hits the first's prefix) as "*";
    floats (logprobs: a cached prefix changes them in the last digits) as "f", collected apart."""
    if isinstance(event, dict):
        return {k: ("*" if k in ("id", "created", "cached_tokens") else _normalised(v, floats))
                for k, v in event.items()}
    if isinstance(event, list):
        return [_normalised(v, floats) for v in event]
    if isinstance(event, float):
        floats.append(event)
        return "f"
    return event


@pytest.mark.parametrize("path, body", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_messages_equal_sse_payloads(server, path, body):
    with httpx.stream("POST", server.url(path), json={**body, "stream": True}, headers=server.headers,
                      timeout=60.0) as r:
        assert r.status_code == 200
        sse = sse_events(r.iter_lines())
    # "stream" is forced on: false is overridden, not refused
    messages, code = _ws_messages(server, path, json.dumps({**body, "stream": False}))
    assert code == 1000
    assert messages[-1] == "[DONE]" and sse[-1] == "[DONE]"
    ws = [json.loads(m) for m in messages[:-1]]
    ws_floats: list[float] = []
    sse_floats: list[float] = []
    assert [_normalised(e, ws_floats) for e in ws] == [_normalised(e, sse_floats) for e in sse[:-1]]
    assert ws_floats == pytest.approx(sse_floats, abs=1e-3)
    assert ws[-1]["usage"]["completion_tokens"] >= 1
    assert len({e["id"] for e in ws}) == 1


@pytest.mark.parametrize("body", ["{not json", "[1, 2]", json.dumps({"model": MODEL_NAME, "prompt": "x",
                                                                        "temperature": "hot"}),
                                  json.dumps({"model": "no-such-model", "prompt": "x"}),
                                  json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 100000})])
def test_invalid_body_is_the_posts_error_then_1008(server, body):
    r = httpx.post(server.url("/v1/completions"), content=body, timeout=60.0,
                   headers={**server.headers, "content-type": "application/json"})
    assert 400 <= r.status_code < 500
    messages, code = _ws_messages(server, "/v1/completions", body)
    assert code == 1008
    assert [json.loads(m) for m in messages] == [r.json()]


def test_what_streams_refuse_is_refused(server):
    # use_beam_search is fine for a POST without stream, refused with it: the socket always streams
    body = json.dumps({"model": MODEL_NAME, "prompt": "x", "use_beam_search": True, "n": 2, "max_tokens": 2})
    messages, code = _ws_messages(server, "/v1/completions", body)
    assert code == 1008 and json.loads(messages[0])["error"]["param"] == "stream"


def test_chat_invalid_messages(server):
    body = json.dumps({"model": MODEL_NAME, "messages": "hi"})
    r = httpx.post(server.url("/v1/chat/completions"), content=body, timeout=60.0,
                   headers={**server.headers, "content-type": "application/json"})
    messages, code = _ws_messages(server, "/v1/chat/completions", body)
    assert code == 1008 and [json.loads(m) for m in messages] == [r.json()]


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_bad_key_is_refused(server, key):
    messages, code = _ws_messages(server, "/v1/chat/completions", None, key=key)
    assert code == 1008
    assert json.loads(messages[0])["error"]["code"] == "invalid_api_key"


@pytest.mark.serial
def test_client_disconnect_aborts_the_request(server):
    wait_idle(server)
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 900, "min_tokens": 900}
    # max_queue=None: the client keeps reading while it closes (with a full queue it would stop, and
    # the server's close frame would wait behind the tokens sent meanwhile until close_timeout).
    with connect(_ws_url(server, "/v1/completions"), additional_headers=server.headers, open_timeout=30,
                 max_queue=None, close_timeout=2) as ws:
        ws.send(json.dumps(body))
        for _ in range(3):
            assert json.loads(ws.recv(timeout=60))["choices"]
        assert server.stats()["num_unfinished_requests"] >= 1
        closing = time.monotonic()
    assert time.monotonic() - closing < 1.5
    stats = wait_idle(server, timeout_s=20)  # closed long before 900 tokens
    assert stats["num_running"] == 0


def test_sse_payloads():
    assert sse_payloads('data: {"a": 1}\n\n') == ['{"a": 1}']
    assert sse_payloads(b"data: [DONE]\n\n") == ["[DONE]"]
    assert sse_payloads('data: {"a": 1}\n\ndata: {"b": 2}\n\n') == ['{"a": 1}', '{"b": 2}']

