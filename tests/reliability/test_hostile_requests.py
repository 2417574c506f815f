"""Bounded work per request: one hostile body (20,000 tools, 10,000 choices, 20,000 prompts, a
runaway chat template) gets a quick 400 naming its field, the engine core does not grow, and
/health keeps answering within 100 ms meanwhile; each limit passes at its value and fails one past.
Also prompt_logprobs, which used to be ignored, now comes back (non-streamed) or is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from rel_helpers import MODEL_NAME, check_error_body, rss_kib

from kvtide.sampling_params import SamplingParams, StructuredOutputsParams
from kvtide.server import limits

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HEALTH_BUDGET_S = 0.25
"""The slowest /health answer allowed while one hostile request is handled. Typically under 20 ms;
on a 2-core machine a runaway template rendering in the server (pure Python, off the event loop)
has pushed single answers to ~190 ms, so the bound is the fuzz tier's, not the 100 ms aimed at."""


def _chat(**extra) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}


def _cmpl(**extra) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, **extra}


def _tool(name: str, description: str | None = None) -> dict:
    function = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = {"type": "object", "properties": {"a": {"type": "string"}}}
    return {"type": "function", "function": function}


_PROBE_SCRIPT = """
import sys, time, httpx
url, out = sys.argv[1], sys.argv[2]
with httpx.Client(timeout=30) as client, open(out, "w", buffering=1) as f:
    client.get(url)  # the connection is open before timing starts
    f.write("ready\\n")
    while True:
        start = time.perf_counter()
        status = client.get(url).status_code
        f.write(f"{time.perf_counter() - start} {status}\\n")
        time.sleep(0.02)
"""


class HealthProbe:
    """GET /health every 20 ms from a process of its own (a thread here would share this process's
    GIL and time it too) while the block runs; `worst` is the slowest answer."""

    def __init__(self, server) -> None:
        self.url = server.url("/health")
        self.latencies: list[float] = []
        self._log = tempfile.NamedTemporaryFile("r", suffix=".health", delete=False)
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> HealthProbe:
        self._process = subprocess.Popen([sys.executable, "-c", _PROBE_SCRIPT, self.url, self._log.name])
        deadline = time.monotonic() + 30
        while "ready" not in open(self._log.name).read():
            assert time.monotonic() < deadline and self._process.poll() is None, "the /health probe did not start"
            time.sleep(0.02)
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        assert self._process is not None
        self._process.kill()
        self._process.wait()
        with open(self._log.name) as f:
            lines = [line.split() for line in f if line.strip() != "ready"]
        os.unlink(self._log.name)
        for parts in lines:
            if len(parts) == 2:  # the last line may have been cut by the kill
                assert parts[1] == "200", parts
                self.latencies.append(float(parts[0]))

    @property
    def worst(self) -> float:
        assert self.latencies
        return max(self.latencies)


def _post_timed(server, path: str, body: dict) -> tuple[httpx.Response, float]:
    with server.client(timeout=120) as client:
        start = time.perf_counter()
        r = client.post(path, json=body)
        return r, time.perf_counter() - start


def _refused(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    error = check_error_body(r.json())
    assert error["param"] == param, error
    return error


# ---- one hostile request -------------------------------------------------------------------------
@pytest.mark.serial
def test_20k_tools_refused_fast_without_growing_the_engine(hostile_server):
    body = _chat(tools=[_tool(f"f{i}") for i in range(20_000)], tool_choice="required")
    assert len(json.dumps(body)) < 4 * 1024 * 1024  # under the body limit: the tools limit decides
    rss_before = rss_kib(hostile_server.engine_pid)
    with HealthProbe(hostile_server) as probe:
        r, elapsed = _post_timed(hostile_server, CHAT, body)
    _refused(r, "tools")
    assert elapsed < 3.0
    assert probe.worst < HEALTH_BUDGET_S, probe.latencies
    assert rss_kib(hostile_server.engine_pid) - rss_before < 200 * 1024


@pytest.mark.serial
def test_20k_tools_over_websocket_refused_without_stalling(hostile_server):
    """The WebSocket twin counts the same tools on the raw message before parsing it."""
    from websockets.sync.client import connect

    body = json.dumps(_chat(tools=[_tool(f"f{i}") for i in range(20_000)], tool_choice="required"))
    url = hostile_server.url(CHAT).replace("http://", "ws://")
    with HealthProbe(hostile_server) as probe:
        with connect(url, additional_headers=hostile_server.headers, open_timeout=30, max_size=None) as ws:
            ws.send(body)
            error = check_error_body(json.loads(ws.recv(timeout=30)))
    assert error["param"] == "tools", error
    assert probe.worst < HEALTH_BUDGET_S, probe.latencies


@pytest.mark.serial
@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_10k_choices_refused(hostile_server, field):
    choices = [f"choice {i}" for i in range(10_000)]
    body = _cmpl(guided_choice=choices) if field == "guided_choice" else _cmpl(structured_outputs={"choice": choices})
    r, elapsed = _post_timed(hostile_server, CMPL, body)
    error = _refused(r, field)
    assert f"at most {limits.STRUCTURED_CHOICES} choices" in error["message"]
    assert elapsed < 3.0


@pytest.mark.serial
def test_20k_prompts_refused_fast(hostile_server):
    with HealthProbe(hostile_server) as probe:
        r, elapsed = _post_timed(hostile_server, CMPL, _cmpl(prompt=["hello there"] * 20_000))
    _refused(r, "prompt")
    assert elapsed < 3.0
    assert probe.worst < HEALTH_BUDGET_S, probe.latencies


def test_request_chat_template_refused_without_the_flag(fuzz_server):
    with fuzz_server.client() as client:
        r = client.post(CHAT, json=_chat(chat_template="{{ messages[0].content }}"))
        assert "--trust-request-chat-template" in _refused(r, "chat_template")["message"]
        r = client.post("/tokenize", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                           "chat_template": "{{ messages[0].content }}"})
        _refused(r, "chat_template")


def test_request_chat_template_accepted_with_the_flag(hostile_server):
    template = "T:{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    with hostile_server.client() as client:
        r = client.post("/tokenize", json={"model": MODEL_NAME, "chat_template": template,
                                           "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        expected = client.post("/tokenize", json={"model": MODEL_NAME, "prompt": "T:[user]hi",
                                                  "add_special_tokens": False}).json()["tokens"]
        assert r.json()["tokens"] == expected
        r = client.post(CHAT, json=_chat(chat_template=template))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(expected)


@pytest.mark.serial
@pytest.mark.parametrize("template,budget_s", [
    ("{{ 'x' * 10000000 }}", 1.0),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", 4.0),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", 4.0),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", 2.0),
], ids=["huge product", "silent nested loop", "printing nested loop", "doubling namespace"])
def test_runaway_chat_template_stopped(hostile_server, template, budget_s):
    with HealthProbe(hostile_server) as probe:
        r, elapsed = _post_timed(hostile_server, CHAT, _chat(chat_template=template))
    error = _refused(r, "chat_template")
    assert "chat template" in error["message"]
    assert elapsed < budget_s
    assert probe.worst < HEALTH_BUDGET_S, probe.latencies
    with hostile_server.client() as client:  # and the server serves on
        assert client.post(CHAT, json=_chat()).status_code == 200


# ---- each limit at its value and one past -------------------------------------------------------
def _tools_of_bytes(size: int, count: int = 64) -> list[dict]:
    """`count` tools whose JSON (as the server measures it) totals exactly `size` bytes."""
    def sized(i: int, nbytes: int) -> dict:
        return _tool(f"f{i:04d}", "d" * (nbytes - len(json.dumps(_tool(f"f{i:04d}", ""), ensure_ascii=False))))

    tools = [sized(i, size // count) for i in range(count - 1)]
    tools.append(sized(count - 1, size - (count - 1) * (size // count)))
    assert sum(len(json.dumps(t, ensure_ascii=False)) for t in tools) == size
    return tools


def _choices_of_bytes(size: int) -> list[str]:
    return [f"{i:03d}" + "c" * 1021 for i in range(size // 1024)] + ["z" * (size % 1024)] * bool(size % 1024)


def _schema_of_bytes(size: int) -> dict:
    schema = {"type": "string", "description": ""}
    schema["description"] = "s" * (size - len(json.dumps(schema)))
    return schema


def _padded_template(size: int) -> str:
    core = "{{ messages[0].content }}"
    return core + "{#" + "p" * (size - len(core) - 4) + "#}"


RENDER_CAP = limits.CHAT_TEMPLATE_OUTPUT_FACTOR * 4 * 1024 * 1024  # hostile_server's --max-request-body 4MiB

LIMITS = [
    # (name, path, body at the limit, body one past, param)
    ("tools", CHAT, _chat(tools=[_tool(f"f{i}") for i in range(limits.DEFAULT_MAX_TOOLS)], tool_choice="none"),
     _chat(tools=[_tool(f"f{i}") for i in range(limits.DEFAULT_MAX_TOOLS + 1)], tool_choice="none"), "tools"),
    ("tools bytes", CHAT, _chat(tools=_tools_of_bytes(limits.DEFAULT_MAX_TOOLS_BYTES), tool_choice="none"),
     _chat(tools=_tools_of_bytes(limits.DEFAULT_MAX_TOOLS_BYTES + 1), tool_choice="none"), "tools"),
    ("choices", CMPL, _cmpl(guided_choice=[f"c{i}" for i in range(limits.STRUCTURED_CHOICES)]),
     _cmpl(guided_choice=[f"c{i}" for i in range(limits.STRUCTURED_CHOICES + 1)]), "guided_choice"),
    ("choice bytes", CMPL, _cmpl(guided_choice=_choices_of_bytes(limits.STRUCTURED_CHOICE_BYTES)),
     _cmpl(guided_choice=_choices_of_bytes(limits.STRUCTURED_CHOICE_BYTES + 1)), "guided_choice"),
    ("json schema bytes", CHAT,
     _chat(response_format={"type": "json_schema",
                            "json_schema": {"name": "s", "schema": _schema_of_bytes(limits.STRUCTURED_SPEC_BYTES)}}),
     _chat(response_format={"type": "json_schema", "json_schema": {
         "name": "s", "schema": _schema_of_bytes(limits.STRUCTURED_SPEC_BYTES + 1)}}), "response_format"),
    ("regex bytes", CMPL, _cmpl(guided_regex="a" * limits.STRUCTURED_GRAMMAR_BYTES),
     _cmpl(guided_regex="a" * (limits.STRUCTURED_GRAMMAR_BYTES + 1)), "guided_regex"),
    ("messages", CHAT, _chat(messages=[{"role": "user", "content": ""}] * limits.MAX_MESSAGES),
     _chat(messages=[{"role": "user", "content": ""}] * (limits.MAX_MESSAGES + 1)), "messages"),
    ("prompts x n", CMPL, _cmpl(prompt=["p"] * (limits.DEFAULT_MAX_PROMPTS_PER_REQUEST // 128), n=128),
     _cmpl(prompt=["p"] * (limits.DEFAULT_MAX_PROMPTS_PER_REQUEST // 128 + 1), n=128), "prompt"),
    ("chat_template bytes", CHAT, _chat(chat_template=_padded_template(limits.MAX_CHAT_TEMPLATE_BYTES)),
     _chat(chat_template=_padded_template(limits.MAX_CHAT_TEMPLATE_BYTES + 1)), "chat_template"),
    ("rendered prompt bytes", CHAT, _chat(chat_template=f"{{{{ 'x' * {RENDER_CAP} }}}}"),
     _chat(chat_template=f"{{{{ 'x' * {RENDER_CAP + 1} }}}}"), "chat_template"),
]


@pytest.mark.parametrize("name,path,at_limit,past_limit,param", LIMITS, ids=[c[0] for c in LIMITS])
def test_request_limits(hostile_server, name, path, at_limit, past_limit, param):
    with hostile_server.client(timeout=120) as client:
        r = client.post(path, json=at_limit)
        # At the limit the request passes its check; a prompt that then cannot fit max_model_len
        # (2,048 messages, 8 MiB of rendered text) is the only other refusal allowed.
        assert r.status_code == 200 or check_error_body(r.json())["code"] == "context_length_exceeded", r.text
        r = client.post(path, json=past_limit)
        error = _refused(r, param)
        assert error["code"] != "context_length_exceeded", error


def test_structured_output_limits_offline():
    with pytest.raises(ValueError, match="at most 256 choices"):
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["c"] * 257))
    with pytest.raises(ValueError, match="structured_outputs.regex: at most"):
        StructuredOutputsParams(regex="a" * (limits.STRUCTURED_GRAMMAR_BYTES + 1))
    assert StructuredOutputsParams(regex="a" * limits.STRUCTURED_GRAMMAR_BYTES).regex


# ---- prompt_logprobs -----------------------------------------------------------------------------
def test_prompt_logprobs_returned_or_refused(hostile_server):
    with hostile_server.client() as client:
        prompt_ids = client.post("/tokenize", json={"model": MODEL_NAME, "prompt": "hello"}).json()["tokens"]
        r = client.post(CMPL, json=_cmpl(prompt="hello", prompt_logprobs=2, n=2))
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            entries = choice["prompt_logprobs"]
            assert len(entries) == len(prompt_ids) and entries[0] is None
            for token_id, entry in zip(prompt_ids[1:], entries[1:], strict=True):
                assert str(token_id) in entry and len(entry) <= 3
                assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
        r = client.post(CHAT, json=_chat(prompt_logprobs=0))
        assert r.status_code == 200, r.text
        entries = r.json()["prompt_logprobs"]
        assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
        assert "prompt_logprobs" not in client.post(CMPL, json=_cmpl()).json()["choices"][0]
        _refused(client.post(CMPL, json=_cmpl(prompt_logprobs=1, stream=True)), "prompt_logprobs")
