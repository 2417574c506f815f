"""Structured output over HTTP: response_format, structured_outputs and guided_* on both endpoints,
through the openai client. The tiny model is random, so every output that matches did so because
the engine masked what the constraint forbids; schemas are small so answers end well within
max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from serve_helpers import MODEL_NAME
from test_errors import check_error

SCHEMA = {"type": "object",
          "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "size"], "additionalProperties": False}
REGEX = r"[a-c]{2}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
GRAMMAR_RE = r"\([0-9](\+[0-9])*\)"
MESSAGES = [{"role": "user", "content": "answer"}]



def matches_schema(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


def matches(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


# (name, request fields, check(text) -> bool) -- the same on both endpoints.
CASES = [
    ("json_schema", {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}},
     matches_schema),
    ("structured regex", {"structured_outputs": {"regex": REGEX}}, matches(REGEX)),
    ("structured choice", {"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ("structured grammar", {"structured_outputs": {"grammar": GRAMMAR}}, matches(GRAMMAR_RE)),
    ("structured json compact", {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     lambda text: matches_schema(text) and re.search(r"\s\s|[\t\n\r]", text) is None),
    ("guided_json", {"guided_json": SCHEMA}, matches_schema),
    ("guided_regex", {"guided_regex": REGEX, "guided_decoding_backend": "xgrammar"}, matches(REGEX)),
    ("guided_choice", {"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ("guided_grammar", {"guided_grammar": GRAMMAR}, matches(GRAMMAR_RE)),
]


def _assert_matches(check, text: str, finish_reason: str) -> None:
    assert finish_reason == "stop", (finish_reason, text)
    assert check(text), text


@pytest.mark.parametrize("name,fields,check", CASES, ids=[c[0] for c in CASES])
def test_completions_constrained(openai_client, name, fields, check):
    response = openai_client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=200, temperature=1.0,
                                                seed=11, n=3, extra_body=fields)
    assert len(response.choices) == 3
    for choice in response.choices:
        _assert_matches(check, choice.text, choice.finish_reason)


@pytest.mark.parametrize("name,fields,check", CASES, ids=[c[0] for c in CASES])
def test_chat_constrained(openai_client, name, fields, check):
    extra = dict(fields)
    response_format = extra.pop("response_format", None)
    kwargs = {"response_format": response_format} if response_format else {}
    response = openai_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200,
                                                     temperature=1.0, seed=12, n=2, extra_body=extra, **kwargs)
    for choice in response.choices:
        _assert_matches(check, choice.message.content, choice.finish_reason)


def test_json_object_on_both_endpoints(openai_client):
    for seed in (1, 2, 3):
        chat = openai_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=200, seed=seed,
            response_format={"type": "json_object"})
        completion = openai_client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=200, seed=seed,
                                                      extra_body={"response_format": {"type": "json_object"}})
        for text, finish in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                             (completion.choices[0].text, completion.choices[0].finish_reason)):
            if finish == "stop":  # a random model may nest objects past max_tokens
                assert isinstance(json.loads(text), dict), text


def test_text_response_format_is_unconstrained(openai_client):
    response = openai_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                                     response_format={"type": "text"})
    assert response.choices[0].message.content is not None


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_constrained_output_matches(openai_client, endpoint):
    fields = {"structured_outputs": {"regex": REGEX}}
    if endpoint == "chat":
        stream = openai_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=50,
                                                       seed=5, n=2, stream=True, extra_body=fields)
        texts: dict[int, str] = {}
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    else:
        stream = openai_client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=50, seed=5, n=2,
                                                  stream=True, extra_body=fields)
        texts = {}
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
    assert len(texts) == 2
    assert all(re.fullmatch(REGEX, t) for t in texts.values()), texts


# ---- refused -------------------------------------------------------------------------------------
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


def _body(path: str, **fields) -> dict:
    base = {"model": MODEL_NAME, "max_tokens": 5}
    base.update({"prompt": "x"} if path == CMPL else {"messages": MESSAGES})
    return dict(base, **fields)


BAD = [
    ("invalid schema", {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "s", "schema": {"type": "objectx"}}}},
     "response_format"),
    ("invalid guided_json", {"guided_json": {"type": "objectx"}}, "guided_json"),
    ("bad regex", {"guided_regex": "[0-9"}, "guided_regex"),
    ("bad structured regex", {"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ("bad grammar", {"guided_grammar": "root ::= nothing_defined"}, "guided_grammar"),
    ("json_schema without schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     "response_format"),
    ("unknown response_format type", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("two sources", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("response_format and structured_outputs", {"response_format": {"type": "json_object"},
                                                "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ("two kinds in structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("empty choice", {"guided_choice": []}, "guided_choice"),
    ("outlines backend", {"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("whitespace pattern", {"guided_json": SCHEMA, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
]


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("name,fields,param", BAD, ids=[c[0] for c in BAD])
def test_bad_constraints_are_400(server, path, name, fields, param):
    with server.client() as client:
        error = check_error(client.post(path, json=_body(path, **fields)), 400, param)
    if name == "two sources":
        assert "guided_regex" in error["message"] and "guided_choice" in error["message"]
    if name == "invalid schema":
        assert "objectx" in error["message"]


def test_constraint_with_beam_search(server):
    with server.client() as client:
        response = client.post(CMPL, json=_body(CMPL, guided_regex="[ab]{3}", use_beam_search=True, n=2,
                                                temperature=0.0))
    assert response.status_code == 200, response.text
    texts = [choice["text"] for choice in response.json()["choices"]]
    assert len(texts) == 2 and all(re.fullmatch("[ab]{3}", t) for t in texts), texts


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_bad_constraint_streamed_is_400_before_the_stream(server, path):
    with server.client() as client:
        check_error(client.post(path, json=_body(path, guided_regex="[0-9", stream=True)), 400, "guided_regex")


def _structured_counters(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith("kvtide:structured_output_"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def test_structured_output_metrics(server):
    """Constrained requests, cache hits, compile times, jump-forward tokens and refused
    constraints, counted on /metrics."""
    schema = {"type": "object", "properties": {"answer_code": {"enum": ["alpha", "beta"]}},
              "required": ["answer_code"]}
    with server.client() as client:
        before = _structured_counters(client.get("/metrics").text)
        for _ in range(2):  # the second finds the grammar compiled
            response = client.post(CMPL, json=_body(CMPL, structured_outputs={"json": schema}, temperature=0.0))
            assert response.status_code == 200
        check_error(client.post(CMPL, json=_body(CMPL, guided_regex="(")), 400, "guided_regex")
        after = _structured_counters(client.get("/metrics").text)

    def gained(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert gained("kvtide:structured_output_requests_total") == 2
    assert gained("kvtide:structured_output_grammar_cache_hits_total") >= 1
    assert gained("kvtide:structured_output_grammar_compile_seconds_count") >= 1
    assert gained("kvtide:structured_output_jump_forward_tokens_total") > 0  # '{"answer_code": "' is forced
    assert gained("kvtide:structured_output_invalid_requests_total") == 1
