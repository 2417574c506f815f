"""API fuzz (issue 7, item 3): nothing a client sends gets a 5xx, every error is OpenAI's error
object, and the engine keeps answering correctly throughout.

Two sources of requests, both against a live `kvtide serve` (fuzz_server):
  * a hand-written table of malformed requests that tests/server/test_errors.py does not already
    cover (NaN/Infinity, huge and negative numbers, huge or empty prompts, vocabulary edges, bad
    UTF-8 and lone surrogates, deep nesting, oversize numbers and headers, unknown fields, list
    limits), with a canary greedy request every CANARY_EVERY cases that must return what the
    offline LLM returns for it on the same checkpoint;
  * schemathesis, generating positive and negative requests from the server's own /openapi.json
    (bounded per operation; the long run is marked slow).
"""

from __future__ import annotations

import collections
import json
import os
import time

import httpx
import pytest
from rel_helpers import FIGURES, FUZZ_VOCAB, MODEL_NAME, check_error_body, check_error_body_for

from kvtide.server.limits import (
    MAX_HEADER_BYTES,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
VOCAB = FUZZ_VOCAB
MODEL_LEN = 128
CANARY_PROMPT, CANARY_TOKENS = "The canary sings", 12
CANARY_EVERY = 25


def cmpl(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "fuzz", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 2, **fields}


def raw_cmpl(fragment: str) -> bytes:
    """A completions body with `fragment` (raw JSON text, e.g. NaN) spliced in as a field."""
    return ('{"model": "' + MODEL_NAME + '", "prompt": "fuzz", "max_tokens": 2, ' + fragment + "}").encode()


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


# (name, path, body: dict (JSON) or bytes (raw), extra headers, expected)
# expected: an int status, "4xx" (any 4xx in OpenAI's format), or "ok" (200 or any 4xx in OpenAI's
# format: the point is only that it is no 5xx and answers in form).
CASES: list[tuple[str, str, object, dict | None, object]] = [
    # ---- NaN / Infinity (Python's json accepts these tokens) -----------------------------------
    ("temperature NaN", CMPL, raw_cmpl('"temperature": NaN'), None, 400),
    ("temperature Infinity", CMPL, raw_cmpl('"temperature": Infinity'), None, 400),
    ("top_p -Infinity", CMPL, raw_cmpl('"top_p": -Infinity'), None, 400),
    ("max_tokens NaN", CMPL, raw_cmpl('"max_tokens": NaN'), None, 400),
    ("logit_bias NaN", CMPL, raw_cmpl('"logit_bias": {"5": NaN}'), None, 400),
    ("logit_bias Infinity", CMPL, raw_cmpl('"logit_bias": {"5": Infinity}'), None, 400),
    ("presence_penalty NaN", CMPL, raw_cmpl('"presence_penalty": NaN'), None, 400),
    ("seed NaN", CMPL, raw_cmpl('"seed": NaN'), None, 400),
    ("n Infinity", CMPL, raw_cmpl('"n": Infinity'), None, 400),
    ("repetition_penalty Infinity", CMPL, raw_cmpl('"repetition_penalty": Infinity'), None, 400),
    ("min_p NaN", CMPL, raw_cmpl('"min_p": NaN'), None, 400),
    ("prompt [NaN]", CMPL, b'{"prompt": [NaN], "max_tokens": 2}', None, 400),
    ("chat temperature NaN", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     None, 400),
    ("max_tokens 1e999 (inf)", CMPL, raw_cmpl('"max_tokens": 1e999'), None, 400),
    # ---- negative and huge numbers -------------------------------------------------------------
    ("max_tokens -1", CMPL, cmpl(max_tokens=-1), None, 400),
    ("max_tokens 1e308", CMPL, cmpl(max_tokens=1e308), None, 400),
    ("max_tokens 2**64", CMPL, cmpl(max_tokens=2**64), None, 400),
    ("max_tokens 5000 digits", CMPL, raw_cmpl('"max_tokens": 1' + "0" * 5000), None, 400),
    ("n -5", CMPL, cmpl(n=-5), None, 400),
    ("n 2**63", CMPL, cmpl(n=2**63), None, 400),
    ("top_k 2**40", CMPL, cmpl(top_k=2**40), None, "ok"),
    ("top_k 1e30", CMPL, cmpl(top_k=1e30), None, 400),
    ("temperature 1e300", CMPL, cmpl(temperature=1e300), None, 400),
    ("temperature -0.0", CMPL, cmpl(temperature=-0.0), None, 200),
    ("seed -2**64", CMPL, cmpl(seed=-(2**64)), None, 400),
    ("seed -2**63", CMPL, cmpl(seed=-(2**63), temperature=1.0), None, 200),
    ("priority 2**40", CMPL, cmpl(priority=2**40), None, 400),
    ("priority -2**40", CMPL, cmpl(priority=-(2**40)), None, 400),
    ("min_tokens -1", CMPL, cmpl(min_tokens=-1), None, 400),
    ("min_tokens 2**40", CMPL, cmpl(min_tokens=2**40), None, 400),
    ("logprobs -1", CMPL, cmpl(logprobs=-1), None, 400),
    ("logprobs 2**40", CMPL, cmpl(logprobs=2**40), None, 400),
    ("best_of 0", CMPL, cmpl(best_of=0), None, 400),
    ("best_of 2**40", CMPL, cmpl(best_of=2**40), None, 400),
    ("repetition_penalty -1", CMPL, cmpl(repetition_penalty=-1), None, 400),
    ("stop_token_ids 2**63", CMPL, cmpl(stop_token_ids=[2**63]), None, 400),
    ("prompt token 2**63", CMPL, cmpl(prompt=[2**63]), None, 400),
    ("prompt nested token 2**40", CMPL, cmpl(prompt=[[2**40]]), None, 400),
    ("prompt float token", CMPL, cmpl(prompt=[1000.0]), None, 400),
    ("prompt bool token", CMPL, cmpl(prompt=[True]), None, 400),
    ("chat max_completion_tokens 2**64", CHAT, chat(max_completion_tokens=2**64), None, 400),
    ("chat top_logprobs -1", CHAT, chat(logprobs=True, top_logprobs=-1), None, 400),
    ("detokenize 2**63", "/detokenize", {"tokens": [2**63]}, None, 400),
    ("detokenize -1", "/detokenize", {"tokens": [-1]}, None, 400),
    ("detokenize out of vocab", "/detokenize", {"tokens": [VOCAB]}, None, 400),
    # ---- empty and huge prompts ----------------------------------------------------------------
    ("prompt [[]]", CMPL, cmpl(prompt=[[]]), None, 400),
    ("prompt ['', 'a']", CMPL, cmpl(prompt=["", "a"]), None, "ok"),
    ("prompt whitespace", CMPL, cmpl(prompt="   "), None, 200),
    ("prompt NUL", CMPL, cmpl(prompt="a\u0000b"), None, 200),
    ("prompt 60k chars", CMPL, cmpl(prompt="x" * 60000), None, 400),
    ("prompt 10k token ids", CMPL, cmpl(prompt=[5] * 10000), None, 400),
    ("prompt fills the context", CMPL, cmpl(prompt=[5] * MODEL_LEN), None, 400),
    ("chat empty content", CHAT, chat(messages=[{"role": "user", "content": ""}]), None, 200),
    ("chat huge content", CHAT, chat(messages=[{"role": "user", "content": "y" * 60000}]), None, 400),
    ("chat many messages", CHAT, chat(messages=[{"role": "user", "content": "m"}] * 2000), None, 400),
    ("tokenize huge", "/tokenize", {"prompt": "z" * 60000}, None, "ok"),
    # ---- token ids at the vocabulary's edges --------------------------------------------------
    ("prompt token == vocab", CMPL, cmpl(prompt=[VOCAB]), None, 400),
    ("prompt token vocab-1", CMPL, cmpl(prompt=[VOCAB - 1]), None, 200),
    ("prompt lists, one bad", CMPL, cmpl(prompt=[[1, 2], [999]]), None, 400),
    ("stop_token_ids == vocab", CMPL, cmpl(stop_token_ids=[VOCAB]), None, 400),
    ("logit_bias key == vocab", CMPL, cmpl(logit_bias={str(VOCAB): 1}), None, 400),
    ("logit_bias key -1", CMPL, cmpl(logit_bias={"-1": 1}), None, 400),
    ("logit_bias key 1.5", CMPL, cmpl(logit_bias={"1.5": 1}), None, 400),
    ("logit_bias key empty", CMPL, cmpl(logit_bias={"": 1}), None, 400),
    ("logit_bias key 2**70", CMPL, cmpl(logit_bias={str(2**70): 1}), None, 400),
    ("logit_bias key ' 5'", CMPL, cmpl(logit_bias={" 5": 1}), None, "ok"),
    # ---- encodings: invalid UTF-8, lone surrogates, BOM, UTF-16 ---------------------------------
    ("invalid utf-8 in string", CMPL, b'{"prompt": "\xff\xfe", "max_tokens": 2}', None, 400),
    ("truncated utf-8 sequence", CMPL, b'{"prompt": "a\xc3", "max_tokens": 2}', None, 400),
    ("overlong utf-8", CMPL, b'{"prompt": "\xc0\xaf", "max_tokens": 2}', None, 400),
    ("lone surrogate prompt", CMPL, b'{"prompt": "a\\ud800b", "max_tokens": 2}', None, 400),
    ("lone surrogate chat", CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', None,
     400),
    ("lone surrogate stop", CMPL, b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}', None, 400),
    ("lone surrogate tokenize", "/tokenize", b'{"prompt": "\\ud83d"}', None, 400),
    ("surrogate pair is fine", CMPL, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}', None, 200),
    ("utf-16 body", CMPL, json.dumps(cmpl()).encode("utf-16"), None, "ok"),
    ("utf-8 BOM body", CMPL, b"\xef\xbb\xbf" + json.dumps(cmpl()).encode(), None, "ok"),
    # ---- non-object JSON and deep nesting -----------------------------------------------------
    ("json true", CMPL, b"true", None, 400),
    ("chat {}", CHAT, b"{}", None, 400),
    ("trailing garbage", CMPL, b'{"prompt": "a", "max_tokens": 2} trailing', None, 400),
    ("duplicate keys", CMPL, b'{"prompt": "a", "prompt": 5, "max_tokens": 2}', None, 400),
    ("deep array prompt", CMPL, ('{"prompt": ' + nested(30_000) + "}").encode(), None, 400),
    ("deep array unknown field", CMPL, raw_cmpl('"extra": ' + nested(30_000)), None, "ok"),
    ("deep objects", CMPL, ('{"a":' * 10_000 + "1" + "}" * 10_000).encode(), None, 400),
    ("deep array past the body limit", CMPL, ('{"prompt": ' + nested(100_000) + "}").encode(), None, 413),
    ("deep chat content", CHAT, ('{"messages": [{"role": "user", "content": ' + nested(30_000, '"x"') + "}]}").encode(),
     None, 400),
    ("deep stream_options", CMPL, raw_cmpl('"stream": true, "stream_options": {"include_usage": '
                                           + nested(30_000, "true") + "}"), None, 400),
    # ---- headers ------------------------------------------------------------------------------
    ("header over our limit", CMPL, cmpl(), {"X-Pad": "p" * (MAX_HEADER_BYTES + 1)}, 431),
    ("many small headers", CMPL, cmpl(), {f"X-H{i}": "v" for i in range(300)}, 200),
    ("content-type text/plain", CMPL, cmpl(), {"Content-Type": "text/plain"}, 415),
    ("content-encoding gzip lie", CMPL, cmpl(), {"Content-Encoding": "gzip"}, "ok"),
    ("accept nonsense", CMPL, cmpl(), {"Accept": "image/png"}, 200),
    # ---- unknown fields -----------------------------------------------------------------------
    ("unknown field", CMPL, cmpl(foo=1), None, 200),
    ("unknown field object", CMPL, cmpl(foo={"bar": [1, 2, {"baz": None}]}), None, 200),
    ("chat functions", CHAT, chat(functions=[{"name": "f"}]), None, 200),
    ("stream_options extra key", CMPL, cmpl(stream=True, stream_options={"include_usage": True, "x": 1}), None,
     200),
    # ---- list limits (at the limit: tests/reliability/test_security.py) ------------------------
    ("stop strings over limit", CMPL, cmpl(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), None, 400),
    ("stop string too long", CMPL, cmpl(stop=["q" * (MAX_STOP_STRING_CHARS + 1)]), None, 400),
    ("logit_bias over limit", CMPL, cmpl(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}), None, 400),
    ("stop_token_ids over limit", CMPL, cmpl(stop_token_ids=[3] * (MAX_STOP_TOKEN_IDS + 1)), None, 400),
    ("chat stop over limit", CHAT, chat(stop=["s"] * (MAX_STOP_STRINGS + 1)), None, 400),
    ("stop non-string", CMPL, cmpl(stop=[1]), None, 400),
    ("stop empty string", CMPL, cmpl(stop=[""]), None, 400),
    # ---- wrong types elsewhere ---------------------------------------------------------------
    ("model int", CMPL, cmpl(model=5), None, 400),
    ("chat role int", CHAT, chat(messages=[{"role": 1, "content": "x"}]), None, 400),
    ("chat text part None", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), None, 400),
    ("chat response_format string", CHAT, chat(response_format="json"), None, 400),
    ("chat_template_kwargs list", CHAT, chat(chat_template_kwargs=[1]), None, 400),
    ("chat_template raises", CHAT, chat(chat_template="{{ raise_exception('no') }}"), None, 400),
    ("user int", CMPL, cmpl(user=5), None, 400),
    ("stream null", CMPL, cmpl(stream=None), None, 400),
    ("echo string", CMPL, cmpl(echo="yes"), None, 400),
    ("ignore_eos int", CMPL, cmpl(ignore_eos=1), None, 400),
    ("tokenize prompt and messages", "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
     None, 400),
    ("POST /v1/models", "/v1/models", {}, None, 405),
    ("unknown internal route", "/internal/nothing", {}, None, 404),
]


def _send(client: httpx.Client, path: str, body: object, headers: dict | None) -> httpx.Response:
    kwargs: dict = {"headers": headers or {}}
    if isinstance(body, bytes):
        kwargs["content"] = body
        kwargs["headers"] = {"content-type": "application/json", **kwargs["headers"]}
    else:
        kwargs["json"] = body
    return client.post(path, **kwargs)


def _check_canary(client: httpx.Client, expected: tuple[str, str | None, int]) -> None:
    r = client.post(CMPL, json={"model": MODEL_NAME, "prompt": CANARY_PROMPT, "max_tokens": CANARY_TOKENS,
                                "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]) == expected


def test_malformed_table(fuzz_server, fuzz_reference):
    expected_canary = fuzz_reference.greedy(CANARY_PROMPT, CANARY_TOKENS)
    statuses: collections.Counter = collections.Counter()
    problems = []
    canaries = 0
    with fuzz_server.client(timeout=120.0) as client:
        _check_canary(client, expected_canary)
        for i, (name, path, body, headers, expected) in enumerate(CASES, start=1):
            r = _send(client, path, body, headers)
            statuses[f"{r.status_code // 100}xx"] += 1
            problem = _judge(r, expected)
            if problem:
                problems.append(f"{name}: {problem}")
            if i % CANARY_EVERY == 0:
                _check_canary(client, expected_canary)
                canaries += 1
        _check_canary(client, expected_canary)
        assert client.post("/internal/check_integrity").json() == {"ok": True}
    FIGURES["fuzz_table"] = {"cases": len(CASES), "status_classes": dict(statuses), "canaries": canaries + 2}
    assert not problems, "\n".join(problems)
    assert len(CASES) >= 100


def _judge(r: httpx.Response, expected: object) -> str | None:
    if r.status_code >= 500:
        return f"{r.status_code}: {r.text[:300]}"
    if r.status_code == 200:
        if expected in (200, "ok"):
            return None
        return f"expected {expected}, got 200: {r.text[:200]}"
    try:
        check_error_body(r.json())
    except (AssertionError, ValueError) as e:
        return f"{r.status_code} not in OpenAI's error format ({e}): {r.text[:200]}"
    if expected in ("4xx", "ok"):
        return None if 400 <= r.status_code < 500 else f"expected a 4xx, got {r.status_code}"
    return None if r.status_code == expected else f"expected {expected}, got {r.status_code}: {r.text[:200]}"


def test_header_far_past_every_limit(fuzz_server):
    """Past uvicorn's own parser limit the app never sees the request: whatever comes back (a bare
    400 or a closed connection) is no 5xx, and the server goes on."""
    try:
        r = httpx.post(fuzz_server.url(CMPL), json=cmpl(), timeout=30.0,
                       headers={**fuzz_server.headers, "X-Pad": "p" * (1 << 20)})
        assert r.status_code < 500, r.text
    except httpx.TransportError:
        pass
    assert httpx.get(fuzz_server.url("/health"), timeout=10).status_code == 200


def test_sse_events_stay_one_line():
    """Found by the load test: sampled text held U+0085, which json.dumps leaves raw and
    str.splitlines() (httpx's aiter_lines) breaks on, splitting one event in two."""
    from kvtide.server.openai.common import sse

    text = "a\u2028b\x85c\u2029d\ne\rf\x0bg\x1ch"
    event = sse({"choices": [{"text": text}]})
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: "):])["choices"][0]["text"] == text


# ---- schemathesis --------------------------------------------------------------------------------
FUZZ_EXAMPLES = int(os.environ.get("KVTIDE_SCHEMA_FUZZ_EXAMPLES", "320"))
_BOUNDS = {"n": 2, "best_of": 2, "max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "min_tokens": 2,
           "logprobs": 2, "top_logprobs": 2}


def _bound_positive(body: object) -> object:
    """Valid requests may ask for 128 samples of 127 tokens each: cap the sizes (keeping them valid)
    so a bounded run spends its time on variety, not on decoding."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key, cap in _BOUNDS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if body.get("best_of") is not None and body.get("n") is not None:
        body["best_of"] = body["n"]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 2 and all(isinstance(p, (str, list)) for p in prompt):
        body["prompt"] = prompt[:2]
    if body.get("max_tokens") is None and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    return body


def _run_schemathesis(server, reference, total_examples: int) -> dict:
    """Fuzz every operation of the server's OpenAPI schema, positive and negative cases, spending
    about `total_examples` requests in all (spread evenly, at least 4 a case kind), so the tier's
    time stays bounded as the API grows."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    spec = httpx.get(server.url("/openapi.json"), headers=server.headers, timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    expected_canary = reference.greedy(CANARY_PROMPT, CANARY_TOKENS)
    statuses: collections.Counter = collections.Counter()
    problems: list[str] = []
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.path for op in operations} >= {CMPL, CHAT, "/tokenize", "/detokenize"}
    examples = max(4, total_examples // (2 * len(operations)))
    session = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120.0)
    count = 0
    started = time.monotonic()

    def send(case, mode: GenerationMode) -> None:
        nonlocal count
        has_body = type(case.body).__name__ != "NotSet"  # schemathesis's marker for "no body"
        body = case.body if has_body else None
        if mode == GenerationMode.POSITIVE:
            body = _bound_positive(body)
        kwargs: dict = {"params": case.query or None}
        if has_body and case.method.upper() in ("POST", "PUT", "PATCH"):
            kwargs["content"] = json.dumps(body, allow_nan=True).encode() if not isinstance(body, bytes) else body
            kwargs["headers"] = {"content-type": "application/json"}
        try:
            r = session.request(case.method.upper(), case.formatted_path, **kwargs)
        except httpx.TimeoutException:
            problems.append(f"{case.method} {case.formatted_path} timed out: {str(body)[:200]}")
            return
        count += 1
        statuses[f"{r.status_code // 100}xx"] += 1
        if r.status_code >= 500:
            problems.append(f"{case.method} {case.formatted_path} -> {r.status_code}: {r.text[:200]} "
                            f"(body {str(body)[:300]})")
        elif r.status_code >= 400:
            try:
                check_error_body_for(case.formatted_path, r.json())
            except (AssertionError, ValueError) as e:
                problems.append(f"{case.method} {case.formatted_path} -> {r.status_code} not the route's error "
                                f"format: {e}")
        if count % CANARY_EVERY == 0:
            _check_canary(session, expected_canary)

    try:
        def fuzz(op, mode: GenerationMode):
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                send(case, mode)

            return run

        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                try:
                    fuzz(op, mode)()
                except Exception as e:  # e.g. a negative strategy that cannot be built for an operation
                    if "Unsatisfiable" not in type(e).__name__:
                        problems.append(f"{op.method} {op.path} {mode.value}: generation failed: {e!r}"[:300])
        _check_canary(session, expected_canary)
        assert session.post("/internal/check_integrity").json() == {"ok": True}
    finally:
        session.close()
    assert not problems, "\n".join(problems[:30])
    return {"operations": len(operations), "requests": count, "status_classes": dict(statuses),
            "seconds": round(time.monotonic() - started, 1)}


def test_schemathesis_bounded(fuzz_server, fuzz_reference):
    FIGURES["schemathesis"] = _run_schemathesis(fuzz_server, fuzz_reference, FUZZ_EXAMPLES)


@pytest.mark.slow
def test_schemathesis_long(fuzz_server, fuzz_reference):
    FIGURES["schemathesis_long"] = _run_schemathesis(fuzz_server, fuzz_reference, 3200)
