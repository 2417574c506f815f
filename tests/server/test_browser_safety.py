"""A web page cannot drive the server: a cross-origin WebSocket is refused before its handshake,
only JSON bodies are read (text/plain, forms and bare Blobs are what a page may POST cross-origin
without asking), and a server bound to loopback answers only to loopback Host names (DNS
rebinding). Non-browser clients (the openai client, curl with -H 'Content-Type: application/json')
notice nothing.

The session `server` (127.0.0.1, --api-key) for the real paths; a stub engine behind build_app for
the policies only a non-loopback bind or extra flags reach."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest
from serve_helpers import MODEL_NAME
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from kvtide.server.browser_policy import BrowserPolicy, normalize_origin, parse_list_flag
from kvtide.server.cli import _browser_flags, register

CMPL = "/v1/completions"
WS_BODY = json.dumps({"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
EVIL = "evil.example"


def _ws_run(server, origin: str | None) -> tuple[list[str], int]:
    """Every message of a completion over WebSocket sent from a page at `origin`, and the close code."""
    url = server.url(CMPL).replace("http://", "ws://")
    messages = []
    with connect(url, origin=origin, additional_headers=server.headers, open_timeout=30) as ws:
        ws.send(WS_BODY)
        try:
            while True:
                messages.append(ws.recv(timeout=60))
        except ConnectionClosed as e:
            return messages, e.rcvd.code


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


# ---- WebSocket Origin ----------------------------------------------------------------------------
def test_cross_origin_websocket_is_refused(server):
    for _ in range(2):
        with pytest.raises(InvalidStatus) as refused:
            _ws_run(server, f"http://{EVIL}")
        response = refused.value.response
        assert response.status_code == 403
        error = json.loads(response.body)["error"]  # no token: the socket never opened
        assert error["code"] == "origin_not_allowed" and error["type"] == "permission_error"
    # Another loopback port's page is a different origin, yet on this machine: allowed. A page
    # rebound to this port under a foreign name is not.
    with pytest.raises(InvalidStatus):
        _ws_run(server, f"http://{EVIL}:{server.port}")
    with pytest.raises(InvalidStatus):
        _ws_run(server, "null")  # sandboxed frames and file:// pages
    # Logged, once per origin however often it tries.
    assert server.log().count(f"refused a request with Origin 'http://{EVIL}'") == 1


@pytest.mark.parametrize("origin", ["same", "http://localhost:3000", "http://[::1]:5173", None],
                         ids=["same-origin", "localhost page", "ipv6 loopback page", "no origin"])
def test_allowed_origins_stream(server, origin):
    origin = server.base_url if origin == "same" else origin
    messages, code = _ws_run(server, origin)
    assert code == 1000 and messages[-1] == "[DONE]"
    assert "".join(json.loads(m)["choices"][0]["text"] for m in messages[:-1] if json.loads(m)["choices"])


def test_cross_origin_posts_are_refused(server):
    """A page may send an empty or JSON-less POST cross-origin without a preflight (e.g. to an admin
    route): the browser's Origin header gives it away."""
    with server.client() as c:
        for path, body in (("/internal/check_integrity", None), ("/reset_prefix_cache", None),
                           (CMPL, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})):
            _error(c.post(path, json=body, headers={"origin": f"http://{EVIL}"}), 403, "origin_not_allowed")
        for origin in (server.base_url, "http://localhost:3000"):
            assert c.post(CMPL, json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1},
                          headers={"origin": origin}).status_code == 200, origin
        assert c.get("/v1/models", headers={"origin": f"http://{EVIL}"}).status_code == 200  # reads change nothing


# ---- JSON bodies only ----------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None, "application/jsonp"])
def test_json_endpoints_refuse_other_content_types(server, content_type):
    body = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}).encode()
    headers = {**server.headers, **({"content-type": content_type} if content_type else {})}
    request = httpx.Request("POST", server.url(CMPL), content=body, headers=headers)
    if content_type is None:
        request.headers.pop("content-type", None)  # what fetch() sends for a Blob body without a type
    with httpx.Client(timeout=60) as c:
        _error(c.send(request), 415, "unsupported_media_type")


def test_json_with_parameters_and_bodyless_posts_pass(server):
    body = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
    with server.client() as c:
        for content_type in ("application/json", "Application/JSON; charset=utf-8"):
            assert c.post(CMPL, content=body, headers={"content-type": content_type}).status_code == 200
        assert c.post("/internal/check_integrity").json() == {"ok": True}  # no body: no type needed


# ---- Host ----------------------------------------------------------------------------------------
def test_foreign_host_is_refused(server):
    with server.client() as c:
        for host in (EVIL, f"{EVIL}:{server.port}", "127.0.0.1.evil.example"):
            error = _error(c.get("/v1/models", headers={"host": host}), 400, "invalid_host")
            assert error["param"] == "Host"
            _error(c.post(CMPL, json={"prompt": "x", "max_tokens": 1}, headers={"host": host}), 400, "invalid_host")
        assert c.get("/", headers={"host": EVIL}).status_code == 400  # the chat page too
        for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}", "LOCALHOST"):
            assert c.get("/v1/models", headers={"host": host}).status_code == 200, host
        assert httpx.get(server.url("/health"), headers={"host": EVIL}).status_code == 200  # probes pass
    # A WebSocket handshake under a foreign name: refused before it opens.
    handshake = {"host": EVIL, "connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
                 "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==", **server.headers}
    _error(httpx.get(server.url(CMPL), headers=handshake, timeout=30), 400, "invalid_host")


def test_openai_client_still_works(openai_client):
    reply = openai_client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens >= 1
    chunks = list(openai_client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, stream=True))
    assert any(chunk.choices and chunk.choices[0].text for chunk in chunks)


# ---- the policies a loopback bind does not reach (a stub engine) -----------------------------------
class _StubEngine:
    is_dead = False


def _app_client(**settings):
    from fastapi.testclient import TestClient

    from kvtide.server.api_server import build_app
    from kvtide.server.metrics import ServerMetrics
    from kvtide.server.state import ServerSettings, ServerState

    state = ServerState(engine=_StubEngine(), settings=ServerSettings(served_model_names=["m"], api_key="k",
                                                                      **settings), metrics=ServerMetrics("m"))
    return TestClient(build_app(state), base_url="http://app.example:8000")


def _ws_outcome(client, origin: str) -> int:
    """403 when the Origin is refused, else the close code of the key check behind it (1008)."""
    from starlette.testclient import WebSocketDenialResponse

    try:
        with client.websocket_connect("ws://app.example:8000" + CMPL, headers={"origin": origin}) as ws:
            assert json.loads(ws.receive_text())["error"]["code"] == "invalid_api_key"
            return ws.receive()["code"]
    except WebSocketDenialResponse as e:
        return e.status_code


def test_origin_policy_behind_a_public_bind():
    client = _app_client()  # bound to 0.0.0.0: any Host
    assert _ws_outcome(client, "http://app.example:8000") == 1008  # same origin: passes to the key check
    assert _ws_outcome(client, "https://app.example:8000") == 1008
    assert _ws_outcome(client, "http://app.example:8001") == 403
    assert _ws_outcome(client, "https://other.example") == 403
    listed = _app_client(allowed_origins=["https://other.example"])
    assert _ws_outcome(listed, "https://other.example") == 1008
    assert _ws_outcome(listed, "https://third.example") == 403
    assert _ws_outcome(_app_client(allowed_origins=["*"]), "https://third.example") == 1008


def test_allowed_hosts_restricts_a_public_bind():
    client = _app_client(allowed_hosts=["api.example.com", "*.internal"])
    key = {"authorization": "Bearer k"}
    assert client.get("/version", headers={**key, "host": "api.example.com:8000"}).status_code == 200
    assert client.get("/version", headers={**key, "host": "a.b.internal"}).status_code == 200
    assert client.get("/version", headers={**key, "host": "app.example:8000"}).status_code == 400
    assert client.get("/version", headers={**key, "host": "localhost"}).status_code == 400  # as listed


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", "demo", *flags])


def test_flags():
    assert _browser_flags(_serve_args()) == ([], ["localhost", "127.0.0.1", "::1"])
    assert _browser_flags(_serve_args("--host", "::1"))[1] == ["localhost", "127.0.0.1", "::1"]
    assert _browser_flags(_serve_args("--host", "0.0.0.0")) == ([], None)
    # vLLM's JSON list, repeated flags and several values all work; origins are normalized.
    origins, _ = _browser_flags(_serve_args("--allowed-origins", '["HTTPS://A.example:443/"]',
                                            "--allowed-origins", "http://b.example:81", "http://c.example"))
    assert origins == ["https://a.example", "http://b.example:81", "http://c.example"]
    assert _browser_flags(_serve_args("--allowed-hosts", "*"))[1] is None
    assert _browser_flags(_serve_args("--host", "0.0.0.0", "--allowed-hosts", "a.lan,b.lan"))[1] == ["a.lan", "b.lan"]
    for bad in (["--allowed-origins", "evil.example"], ["--allowed-origins", "ftp://x"],
                ["--allowed-origins", '["a", 1]']):
        with pytest.raises(ValueError, match="--allowed-origins"):
            _browser_flags(_serve_args(*bad))
    assert parse_list_flag(None) == [] and normalize_origin("http://[::1]:80") == "http://[::1]"


def test_host_and_origin_parsing_edge_cases():
    policy = BrowserPolicy([], ["localhost", "127.0.0.1", "::1"])
    assert policy.host_allowed("127.0.0.2:9") and policy.host_allowed("[::1]") and policy.host_allowed(None)
    for host in ("localhost.evil.example", "127.0.0.1:80@evil.example", "[::1]evil", "0.0.0.0:8000"):
        assert not policy.host_allowed(host), host
    for origin in ("http://evil.example", "http://localhost.evil.example", "http://127.0.0.1.nip.io", "javascript:1",
                   "http://localhost:99999"):
        assert not policy.origin_allowed(origin, "127.0.0.1:8000", "ws"), origin
