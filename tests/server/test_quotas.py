"""Per-key quotas (--api-keys-file): the file's validation, the accounting, and a real server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_helpers import API_KEY, MODEL_NAME, free_port, launch_server, sse_events, wait_idle

from kvtide.server.quotas import QuotaTracker, TokenCounter, default_key_name, load_api_keys, parse_api_keys

SECRET = "sk-secret-do-not-print"

KEYS = {"keys": [
    {"key": "sk-rpm-111", "name": "rpm-team", "requests_per_minute": 2},
    {"key": "sk-tpm-222", "name": "tpm-team", "tokens_per_minute": 10},
    {"key": "sk-tpmjson-333", "name": "tpm-json-team", "tokens_per_minute": 10, "requests_per_minute": None},
    {"key": "sk-conc-444", "name": "conc-team", "max_concurrent": 1},
    {"key": "sk-free-555"},
    *({"key": f"sk-long-{transport}", "name": f"long-{transport}", "tokens_per_minute": 50}
      for transport in ("completion", "chat", "websocket")),
]}
LONG_PROMPT = "hello " * 120
"""Hundreds of tokens: far over the long-* keys' 50 tokens per minute in one streamed request."""


# ---- the file ------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, fragment", [
    ("{not json", "not valid JSON"),
    ("[]", "top level must be an object"),
    ("{}", "'keys' must be a list"),
    ('{"keys": []}', "'keys' is empty"),
    ('{"keys": {"a": 1}}', "'keys' must be a list"),
    ('{"keys": [], "extra": 1}', "unknown top-level field"),
    ('{"keys": ["sk-x"]}', "keys[0] must be an object"),
    ('{"keys": [{"name": "a"}]}', "keys[0] ('a'): 'key' must be a non-empty string"),
    ('{"keys": [{"key": 12}]}', "'key' must be a non-empty string"),
    ('{"keys": [{"key": ""}]}', "'key' must be a non-empty string"),
    ('{"keys": [{"key": "sk a"}]}', "printable ASCII without spaces"),
    ('{"keys": [{"key": "K", "requests_per_minute": -1}]}', "'requests_per_minute' must be a positive integer"),
    ('{"keys": [{"key": "K", "tokens_per_minute": 0}]}', "'tokens_per_minute' must be a positive integer"),
    ('{"keys": [{"key": "K", "max_concurrent": 1.5}]}', "'max_concurrent' must be a positive integer"),
    ('{"keys": [{"key": "K", "max_concurrent": true}]}', "'max_concurrent' must be a positive integer"),
    ('{"keys": [{"key": "K", "requests_per_minute": "60"}]}', "'requests_per_minute' must be a positive integer"),
    ('{"keys": [{"key": "K", "request_per_minute": 60}]}', "unknown field(s) 'request_per_minute'"),
    ('{"keys": [{"key": "K", "name": ""}]}', "'name' must be a non-empty string"),
    ('{"keys": [{"key": "K", "name": 3}]}', "'name' must be a non-empty string"),
    ('{"keys": [{"key": "K"}, {"key": "L"}, {"key": "K"}]}', "keys[0] and keys[2] have the same key"),
    ('{"keys": [{"key": "K", "name": "a"}, {"key": "L", "name": "a"}]}', "keys[0] and keys[1] have the same name 'a'"),
])
def test_load_api_keys_rejects_malformed_files(tmp_path, content, fragment):
    path = tmp_path / "keys.json"
    path.write_text(content.replace('"K"', json.dumps(SECRET)))
    with pytest.raises(ValueError) as info:
        load_api_keys(str(path))
    message = str(info.value)
    assert fragment in message and str(path) in message
    assert SECRET not in message


def test_load_api_keys_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(str(tmp_path / "absent.json"))


def test_load_api_keys_defaults(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    keys = load_api_keys(str(path))
    assert len(keys) == len(KEYS["keys"])
    free = keys.lookup("sk-free-555")
    assert free is not None and free.name == default_key_name("sk-free-555") and free.name.startswith("key-")
    assert "sk-free" not in free.name and "sk-free" not in repr(free)
    assert free.requests_per_minute is free.tokens_per_minute is free.max_concurrent is None
    assert keys.lookup(b"sk-rpm-111").requests_per_minute == 2
    assert keys.lookup("sk-rpm-11") is None and keys.lookup("") is None
    with pytest.raises(ValueError, match="same key"):
        keys.with_key("sk-rpm-111", "other")
    assert keys.with_key("sk-admin", "admin").lookup("sk-admin").name == "admin"
    with pytest.raises(ValueError, match="at least one"):
        parse_api_keys({"keys": []})


# ---- the accounting ------------------------------------------------------------------------------
def test_tracker_windows_and_retry_after():
    now = [1000.0]
    tracker = QuotaTracker(clock=lambda: now[0])
    keys = parse_api_keys({"keys": [{"key": "a", "name": "a", "requests_per_minute": 2, "tokens_per_minute": 100},
                                    {"key": "c", "name": "c", "max_concurrent": 1}]})
    a, c = keys.lookup("a"), keys.lookup("c")
    assert tracker.admit(a) is None
    now[0] += 10
    assert tracker.admit(a) is None
    now[0] += 5
    refusal = tracker.admit(a)
    assert refusal.outcome == "rejected_requests" and refusal.retry_after_s == 45  # the first leaves at 1060
    tracker.release(a)
    tracker.release(a)
    now[0] = 1061  # the request of 1000 left the window; 1010's stays until 1070
    tracker.charge(a, 60)
    now[0] = 1065.5
    tracker.charge(a, 50)
    refusal = tracker.admit(a)
    assert refusal.outcome == "rejected_tokens"  # 110 >= 100; below once the 60 charged at 1061 leave
    assert refusal.retry_after_s == 56  # 1121 - 1065.5 -> 55.5 -> 56
    now[0] = 1121
    assert tracker.tokens_in_window(a) == 50 and tracker.admit(a) is None
    assert tracker.admit(c) is None
    assert tracker.admit(c).outcome == "rejected_concurrency"
    tracker.release(c)
    assert tracker.admit(c) is None


def test_token_counter_reads_usage_or_counts_deltas():
    def chunk(payload) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    delta = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    empty = {"choices": [{"index": 0, "delta": {}}]}
    stream = chunk(delta) + chunk(empty) + chunk(delta) + b"data: [DONE]\n\n"
    counter = TokenCounter()
    counter.observe({"type": "http.response.start", "status": 200,
                     "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
    for i in range(0, len(stream), 7):  # events split across body messages
        counter.observe({"type": "http.response.body", "body": stream[i:i + 7], "more_body": True})
    assert counter.total() == 2
    counter.observe({"type": "http.response.body", "body": chunk({"choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})})
    assert counter.total() == 7
    json_counter = TokenCounter()
    json_counter.observe({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    body = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    json_counter.observe({"type": "http.response.body", "body": body[:5], "more_body": True})
    json_counter.observe({"type": "http.response.body", "body": body[5:]})
    assert json_counter.total() == 7
    ws_counter = TokenCounter()
    ws_counter.observe({"type": "websocket.send", "text": json.dumps({"choices": [{"index": 0, "text": "x"}]})})
    ws_counter.observe({"type": "websocket.send", "text": "[DONE]"})
    assert ws_counter.total() == 1


# ---- a real server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quota_server(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("quotas") / "keys.json"
    path.write_text(json.dumps(KEYS))
    handle = launch_server(llama_dir, "--max-num-seqs", "4", "--api-keys-file", str(path))
    try:
        yield handle
    finally:
        handle.stop()


def _post(server, key: str | None, path: str = "/v1/completions", **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    payload = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0, **body}
    return httpx.post(server.url(path), json=payload, headers=headers, timeout=60.0)


def _metrics(server) -> str:
    r = httpx.get(server.url("/metrics"), headers=server.headers, timeout=30.0)
    assert r.status_code == 200
    return r.text


def _assert_rate_limited(r: httpx.Response) -> dict:
    assert r.status_code == 429, r.text
    retry_after = int(r.headers["retry-after"])
    assert 1 <= retry_after <= 60
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["param"] is None
    assert error["type"] == "rate_limit_error" and error["message"]
    return error


def test_unknown_or_missing_key_is_401(quota_server):
    for key in (None, "sk-wrong", "sk-rpm-11"):
        r = _post(quota_server, key)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(quota_server.url("/v1/models"), headers={"x-api-key": "sk-wrong"})
    assert r.status_code == 401
    assert httpx.get(quota_server.url("/metrics")).status_code == 401  # the quotas skip it; the guard does not
    assert httpx.get(quota_server.url("/metrics"), headers={"x-api-key": "sk-free-555"}).status_code == 200
    assert httpx.get(quota_server.url("/health")).status_code == 200
    assert httpx.get(quota_server.url("/")).status_code == 200  # the chat page


def test_quota_keys_cannot_reach_internal_routes(quota_server):
    for key in ("sk-free-555", "sk-rpm-111"):
        for method, path in (("GET", "/internal/stats"), ("POST", "/internal/check_integrity")):
            r = httpx.request(method, quota_server.url(path), headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    assert quota_server.stats()["num_running"] == 0  # the admin key (here: --api-key's) opens them


def test_requests_per_minute(quota_server):
    assert _post(quota_server, "sk-rpm-111").status_code == 200
    r = httpx.get(quota_server.url("/v1/models"), headers={"x-api-key": "sk-rpm-111"})  # x-api-key counts too
    assert r.status_code == 200
    error = _assert_rate_limited(_post(quota_server, "sk-rpm-111"))
    assert "2 requests per minute" in error["message"] and "rpm-team" in error["message"]
    assert _post(quota_server, "sk-free-555").status_code == 200  # other keys are not affected


def test_tokens_per_minute_from_json_usage(quota_server):
    r = _post(quota_server, "sk-tpmjson-333", prompt="hello there", max_tokens=4, min_tokens=4)
    assert r.status_code == 200
    usage = r.json()["usage"]
    charged = usage["prompt_tokens"] + usage["completion_tokens"]
    assert charged >= 10
    error = _assert_rate_limited(_post(quota_server, "sk-tpmjson-333"))
    assert "10 tokens per minute" in error["message"]
    assert f'kvtide:quota_tokens_total{{key_name="tpm-json-team"}} {float(charged)}' in _metrics(quota_server)


def test_tokens_per_minute_from_stream(quota_server):
    # No include_usage: charged the engine's counts all the same (prompt + 80 completion tokens)
    prompt_tokens = httpx.post(quota_server.url("/tokenize"), headers=quota_server.headers,
                               json={"model": MODEL_NAME, "prompt": "a"}).json()["count"]
    with httpx.stream("POST", quota_server.url("/v1/completions"), headers={"Authorization": "Bearer sk-tpm-222"},
                      json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 80, "min_tokens": 80, "stream": True,
                            "temperature": 0}, timeout=60.0) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    with_text = sum(1 for e in events[:-1] if e["choices"][0]["text"])
    assert with_text >= 10
    _assert_rate_limited(_post(quota_server, "sk-tpm-222"))
    text = _metrics(quota_server)
    assert 'kvtide:quota_requests_total{key_name="tpm-team",outcome="rejected_tokens"} 1.0' in text
    assert f'kvtide:quota_tokens_total{{key_name="tpm-team"}} {float(prompt_tokens + 80)}' in text


def _stream_long_prompt(server, transport: str) -> list:
    """One streamed request of LONG_PROMPT (max_tokens 2, no include_usage) with key long-TRANSPORT."""
    key = f"sk-long-{transport}"
    if transport == "websocket":
        from websockets.sync.client import connect

        url = server.url("/v1/completions").replace("http://", "ws://")
        with connect(url, additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=30) as ws:
            ws.send(json.dumps({"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 2, "min_tokens": 2}))
            messages = []
            while (message := ws.recv(timeout=60)) != "[DONE]":
                messages.append(json.loads(message))
        return messages
    path, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}) \
        if transport == "chat" else ("/v1/completions", {"prompt": LONG_PROMPT})
    with httpx.stream("POST", server.url(path), headers={"Authorization": f"Bearer {key}"}, timeout=60.0,
                      json={"model": MODEL_NAME, "max_tokens": 2, "min_tokens": 2, "stream": True, **body}) as r:
        assert r.status_code == 200
        return sse_events(r.iter_lines())[:-1]


@pytest.mark.parametrize("transport", ["completion", "chat", "websocket"])
def test_streamed_long_prompt_is_charged_its_prompt_tokens(quota_server, transport):
    """A streamed request without usage in its stream costs its prompt's tokens plus those
    generated, as the engine counted them: the key's next request is refused."""
    events = _stream_long_prompt(quota_server, transport)
    assert events and all("usage" not in e or e["usage"] is None for e in events)
    if transport == "chat":
        prompt_tokens = httpx.post(quota_server.url("/tokenize"), headers=quota_server.headers, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": LONG_PROMPT}],
            "add_generation_prompt": True}).json()["count"]
    else:
        prompt_tokens = httpx.post(quota_server.url("/tokenize"), headers=quota_server.headers,
                                   json={"model": MODEL_NAME, "prompt": LONG_PROMPT}).json()["count"]
    assert prompt_tokens > 500
    error = _assert_rate_limited(_post(quota_server, f"sk-long-{transport}"))
    assert "50 tokens per minute" in error["message"] and f"used {prompt_tokens + 2}" in error["message"]
    assert f'kvtide:quota_tokens_total{{key_name="long-{transport}"}} {float(prompt_tokens + 2)}' \
        in _metrics(quota_server)


def test_max_concurrent(quota_server):
    first_chunk = threading.Event()
    release = threading.Event()

    def long_stream() -> None:
        with httpx.stream("POST", quota_server.url("/v1/completions"),
                          headers={"Authorization": "Bearer sk-conc-444"},
                          json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 800, "min_tokens": 800,
                                "stream": True}, timeout=60.0) as r:
            for _ in r.iter_lines():
                first_chunk.set()
                if release.wait(0):
                    break

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        assert first_chunk.wait(60)
        error = _assert_rate_limited(_post(quota_server, "sk-conc-444"))
        assert "1 concurrent" in error["message"]
        assert 'kvtide:quota_inflight{key_name="conc-team"} 1.0' in _metrics(quota_server)
    finally:
        release.set()
        thread.join(60)
    wait_idle(quota_server)
    deadline = time.monotonic() + 10
    while 'kvtide:quota_inflight{key_name="conc-team"} 0.0' not in _metrics(quota_server):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _post(quota_server, "sk-conc-444").status_code == 200


def test_single_api_key_still_works_without_limits(quota_server):
    for _ in range(4):
        r = httpx.get(quota_server.url("/v1/models"), headers=quota_server.headers)
        assert r.status_code == 200
    assert _post(quota_server, API_KEY).status_code == 200
    assert 'kvtide:quota_requests_total{key_name="--api-key",outcome="admitted"}' in _metrics(quota_server)


def test_metrics_by_name_never_the_key(quota_server):
    _post(quota_server, "sk-wrong")
    text = _metrics(quota_server)
    for name in ("rpm-team", "tpm-team", "tpm-json-team", "conc-team", default_key_name("sk-free-555")):
        assert f'kvtide:quota_requests_total{{key_name="{name}",outcome="admitted"}}' in text
        assert f'kvtide:quota_inflight{{key_name="{name}"}}' in text
    assert 'kvtide:quota_requests_total{key_name="unknown",outcome="unauthorized"}' in text
    for entry in KEYS["keys"]:
        assert entry["key"] not in text
    assert API_KEY not in text and "sk-" not in text


def test_websocket_goes_through_the_quotas(quota_server):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url = quota_server.url("/v1/completions").replace("http://", "ws://")
    for _ in range(3):  # use up rpm-team's requests (if test_requests_per_minute's have left the window)
        if _post(quota_server, "sk-rpm-111").status_code == 429:
            break
    for key, close_code, code in (("sk-wrong", 1008, "invalid_api_key"), ("sk-rpm-111", 1013, "rate_limit_exceeded")):
        with connect(url, additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=30) as ws:
            error = json.loads(ws.recv(timeout=30))["error"]
            assert error["code"] == code
            with pytest.raises(ConnectionClosed) as info:
                ws.recv(timeout=30)
            assert info.value.rcvd.code == close_code
    with connect(url, additional_headers={"x-api-key": "sk-free-555"}, open_timeout=30) as ws:
        ws.send(json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, "min_tokens": 3}))
        messages = []
        while (message := ws.recv(timeout=60)) != "[DONE]":
            messages.append(json.loads(message))
    assert sum(1 for m in messages if m["choices"][0]["text"]) >= 1


def test_websocket_refused_while_draining_open_ones_finish(quota_server):
    """Runs last in this module: it drains the module's server."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url = quota_server.url("/v1/completions").replace("http://", "ws://")
    with connect(url, additional_headers=quota_server.headers, open_timeout=30) as ws:
        ws.send(json.dumps({"model": MODEL_NAME, "prompt": "a", "max_tokens": 200, "min_tokens": 200}))
        ws.recv(timeout=60)
        quota_server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(quota_server.url("/health"), timeout=10).status_code != 503:  # handled in a moment
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with connect(url, additional_headers=quota_server.headers, open_timeout=30) as refused:
            assert json.loads(refused.recv(timeout=30))["error"]["code"] == "unavailable"
            with pytest.raises(ConnectionClosed) as info:
                refused.recv(timeout=30)
            assert info.value.rcvd.code == 1013
        while ws.recv(timeout=60) != "[DONE]":  # the open one finishes
            pass
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(timeout=30)
        assert info.value.rcvd.code == 1000
    assert quota_server.proc.wait(60) == 0


def test_bad_keys_file_exits_2_before_loading(llama_dir, tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": SECRET, "tokens_per_minute": -5}]}))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvtide.cli", "serve", llama_dir, "--port", str(free_port()),
                           "--api-keys-file", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tokens_per_minute' must be a positive integer" in proc.stderr and str(path) in proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
    assert "engine core" not in proc.stderr and time.monotonic() - start < 60


def test_api_key_also_in_the_file_exits_2(llama_dir, tmp_path, capsys):
    from kvtide.cli import main

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": API_KEY}]}))
    assert main(["serve", llama_dir, "--port", str(free_port()), "--api-keys-file", str(path),
                 "--api-key", API_KEY]) == 2
    assert "--api-key is also a key" in capsys.readouterr().err
