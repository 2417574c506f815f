"""Malformed requests: each gets its 4xx and OpenAI's error object, and harms nobody else."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import API_KEY, MAX_REQUEST_BODY, MODEL_NAME

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_CMPL = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def cmpl(**overrides):
    return dict(OK_CMPL, **overrides)


def chat(**overrides):
    return dict(OK_CHAT, **overrides)


# (name, path, json body, expected status, expected param (None: don't check), expected code)
JSON_CASES = [
    ("max_tokens string", CMPL, cmpl(max_tokens="5"), 400, "max_tokens", None),
    ("temperature string", CMPL, cmpl(temperature="hot"), 400, "temperature", None),
    ("n float", CMPL, cmpl(n=1.5), 400, "n", None),
    ("stream string", CMPL, cmpl(stream="yes"), 400, "stream", None),
    ("prompt number", CMPL, cmpl(prompt=5), 400, "prompt", None),
    ("prompt mixed list", CMPL, cmpl(prompt=[1, "a"]), 400, "prompt", None),
    ("prompt missing", CMPL, {"model": MODEL_NAME}, 400, "prompt", None),
    ("prompt empty", CMPL, cmpl(prompt=""), 400, "prompt", None),
    ("prompt empty list", CMPL, cmpl(prompt=[]), 400, "prompt", None),
    ("token id out of vocab", CMPL, cmpl(prompt=[5, 10**6]), 400, "prompt", None),
    ("negative token id", CMPL, cmpl(prompt=[-1]), 400, "prompt", None),
    ("stop number", CMPL, cmpl(stop=5), 400, "stop", None),
    ("logit_bias bad key", CMPL, cmpl(logit_bias={"a": 1}), 400, "logit_bias", None),
    ("logit_bias bad value", CMPL, cmpl(logit_bias={"1": "x"}), 400, "logit_bias", None),
    ("logit_bias out of vocab", CMPL, cmpl(logit_bias={"999999": 1}), 400, "logit_bias", None),
    ("logit_bias out of range", CMPL, cmpl(logit_bias={"5": 1000}), 400, "logit_bias", None),
    ("temperature negative", CMPL, cmpl(temperature=-1), 400, "temperature", None),
    ("top_p zero", CMPL, cmpl(top_p=0), 400, "top_p", None),
    ("top_p above 1", CMPL, cmpl(top_p=1.5), 400, "top_p", None),
    ("n zero", CMPL, cmpl(n=0), 400, "n", None),
    ("huge n", CMPL, cmpl(n=100000), 400, "n", None),
    ("max_tokens zero", CMPL, cmpl(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens huge", CMPL, cmpl(max_tokens=10**12), 400, "max_tokens", None),
    ("max_tokens over context", CMPL, cmpl(max_tokens=10**6), 400, "max_tokens", "context_length_exceeded"),
    ("presence_penalty", CMPL, cmpl(presence_penalty=3), 400, "presence_penalty", None),
    ("frequency_penalty", CMPL, cmpl(frequency_penalty=-3), 400, "frequency_penalty", None),
    ("repetition_penalty", CMPL, cmpl(repetition_penalty=0), 400, "repetition_penalty", None),
    ("logprobs too many", CMPL, cmpl(logprobs=21), 400, "logprobs", None),
    ("top_k", CMPL, cmpl(top_k=-2), 400, "top_k", None),
    ("min_p", CMPL, cmpl(min_p=2), 400, "min_p", None),
    ("min_tokens > max_tokens", CMPL, cmpl(min_tokens=5), 400, "min_tokens", None),
    ("stop_token_ids negative", CMPL, cmpl(stop_token_ids=[-1]), 400, "stop_token_ids", None),
    ("stop_token_ids out of vocab", CMPL, cmpl(stop_token_ids=[10**6]), 400, "stop_token_ids", None),
    ("seed too big", CMPL, cmpl(seed=2**70), 400, "seed", None),
    ("seed bool", CMPL, cmpl(seed=True), 400, "seed", None),
    ("stream_options without stream", CMPL, cmpl(stream_options={"include_usage": True}), 400,
     "stream_options", None),
    ("stream_options wrong type", CMPL, cmpl(stream=True, stream_options={"include_usage": 3}), 400,
     "stream_options.include_usage", None),
    ("echo with logprobs streamed", CMPL, cmpl(echo=True, logprobs=1, stream=True), 400, "echo", None),
    ("suffix", CMPL, cmpl(suffix="x"), 400, "suffix", None),
    ("best_of", CMPL, cmpl(best_of=3), 400, "best_of", None),
    ("unknown model", CMPL, cmpl(model="gpt-4"), 404, "model", "model_not_found"),
    ("chat unknown model", CHAT, chat(model="gpt-4"), 404, "model", "model_not_found"),
    ("chat messages string", CHAT, chat(messages="hi"), 400, "messages", None),
    ("chat messages empty", CHAT, chat(messages=[]), 400, "messages", None),
    ("chat message without role", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages", None),
    ("chat image part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages", None),
    ("chat top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    ("chat top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("chat logprobs int", CHAT, chat(logprobs=3), 400, "logprobs", None),
    ("chat max_completion_tokens", CHAT, chat(max_completion_tokens=-1), 400, "max_completion_tokens", None),
    ("chat tools", CHAT, chat(tools=[{"type": "function"}]), 400, "tools", None),
    ("chat response_format", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type", None),
    ("chat request template untrusted", CHAT, chat(chat_template="{% for %}"), 400, "chat_template", None),
    ("chat kv_transfer_params beyond 64 bits", CHAT, chat(kv_transfer_params={"x": 2**70}), 400,
     None, None),
    ("tokenize nothing", "/tokenize", {}, 400, "prompt", None),
    ("detokenize strings", "/detokenize", {"tokens": ["a"]}, 400, "tokens", None),
]


def check_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.mark.parametrize("name,path,body,status,param,code", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_bad_json_fields(client, name, path, body, status, param, code):
    check_error(client.post(path, json=body), status, param, code)


RAW_CASES = [
    ("bad json", b"{bad", "invalid_json"),
    ("truncated json", b'{"prompt": "x"', "invalid_json"),
    ("json array", b"[1, 2]", "invalid_body"),
    ("json string", b'"hello"', "invalid_body"),
    ("json null", b"null", "invalid_body"),
    ("json number", b"3", "invalid_body"),
    ("empty body", b"", "invalid_body"),
    ("not utf-8", b"\xff\xfe{", None),
]


@pytest.mark.parametrize("name,raw,code", RAW_CASES, ids=[c[0] for c in RAW_CASES])
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_bad_bodies(client, path, name, raw, code):
    check_error(client.post(path, content=raw, headers={"content-type": "application/json"}), 400, code=code)


def test_form_content_type_is_refused(client):
    # A form is what a web page may POST cross-origin without asking: only JSON is read as JSON.
    r = client.post(CMPL, content=b'{"prompt": "hi", "max_tokens": 1}',
                    headers={"content-type": "application/x-www-form-urlencoded"})
    check_error(r, 415, param="Content-Type", code="unsupported_media_type")


def test_oversize_body(server, client):
    big = cmpl(prompt="x" * (MAX_REQUEST_BODY + 10))
    error = check_error(client.post(CMPL, json=big), 413, code="request_too_large")
    assert str(MAX_REQUEST_BODY) in error["message"]

    def chunks():  # no Content-Length: the size is counted as the body arrives
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BODY // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=30.0) as c:
        check_error(c.post(CMPL, content=chunks(), headers={"content-type": "application/json"}), 413)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}, {"Authorization": "Bearer"}],
                         ids=["missing", "wrong", "no scheme", "basic", "empty"])
@pytest.mark.parametrize("method,path", [("POST", CMPL), ("POST", CHAT), ("GET", "/v1/models"),
                                         ("GET", "/metrics"), ("POST", "/tokenize"), ("GET", "/version")])
def test_api_key_required(server, headers, method, path):
    r = httpx.request(method, server.url(path), headers=headers, json=OK_CMPL)
    check_error(r, 401, code="invalid_api_key")


def test_health_needs_no_key(server):
    assert httpx.get(server.url("/health")).status_code == 200


def test_unknown_route_and_method(client):
    check_error(client.get("/v1/nothing"), 404)
    check_error(client.get(CMPL), 405)


def test_bad_requests_harm_nobody(client):
    """After everything above, a valid request still works and the engine is consistent."""
    for path, body in ((CMPL, OK_CMPL), (CHAT, OK_CHAT)):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
    assert client.post("/internal/check_integrity").json() == {"ok": True}
    assert client.get("/health").status_code == 200
