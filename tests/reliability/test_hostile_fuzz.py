"""The extended fuzz tier: thousands of hostile and generated requests against one live server, with
/health probed every 100 ms the whole time.

What a hostile client may not do, whatever it sends (each body within the server's body limit, the
way an attacker would shape it): get a 5xx, hold /health past 250 ms, grow the server and its
engine core by a GiB, or leave a KV block behind. The requests are of two kinds, sent from several
threads at once:
  * hand-made hostile bodies, each aimed at one bound: hundreds of tools under tool_choice
    "required", thousands of guided choices, a per-request chat template that multiplies strings or
    loops, thousands of prompts, deep or huge JSON schemas, catastrophic regexes, oversized stop
    lists, the wrong content type, WebSocket-free browser-style posts;
  * schemathesis cases (positive and negative) generated from the server's own /openapi.json.

KVTIDE_HOSTILE_FUZZ_REQUESTS sets how many are sent (default 5,000).
"""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from rel_helpers import (
    FIGURES,
    MAX_REQUEST_BODY,
    MODEL_NAME,
    check_error_body_for,
    children_of,
    rss_kib,
    wait_idle,
)

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
REQUESTS = int(os.environ.get("KVTIDE_HOSTILE_FUZZ_REQUESTS", "5000"))
HEALTH_EVERY_S = 0.1
HEALTH_LIMIT_S = 0.25
"""/health's 99th percentile over the run's ~250 probes."""
HEALTH_WORST_S = 0.5
"""Its single worst probe. On the 2-core machine, alone under the `serial` lock, the worst of ~250
probes was 224, 249 and 282 ms in three full-suite runs (p99 163-201 ms) and 538 ms once under
outside load: a single sample catches scheduler and collector pauses the percentile does not, so
it is bounded at twice the percentile's limit (a stalled server misses both by seconds)."""
RSS_GROWTH_LIMIT_KIB = 1024 * 1024
CLIENT_THREADS = 2
SCHEMA_EXAMPLES = 25
"""schemathesis examples per operation and mode (positive, negative)."""


def _chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def _cmpl(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}


def _tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}


def _fill(make, budget: int) -> list:
    """As many items as fit in a body of `budget` bytes."""
    items: list = []
    size = 0
    while True:
        item = make(len(items))
        size += len(json.dumps(item)) + 2
        if size > budget:
            return items
        items.append(item)


def _nested_schema(depth: int) -> dict:
    """Objects and arrays nested `depth` deep (each level holds the one below once)."""
    schema: dict = {"type": "string"}
    for level in range(depth):
        schema = ({"type": "array", "items": schema} if level % 2 else
                  {"type": "object", "properties": {"a": schema, "b": {"type": "integer"}}, "required": ["a"]})
    return schema


def _hostile_bodies() -> list[tuple[str, str, bytes, str]]:
    """(name, path, raw body, content type), each body within the server's body limit."""
    budget = MAX_REQUEST_BODY - 2048
    many_tools = _fill(_tool, budget)
    many_choices = _fill(lambda i: f"c{i}", budget)
    many_prompts = _fill(lambda i: "p", budget)
    many_messages = _fill(lambda i: {"role": "user", "content": "m"}, budget)
    wide_schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(1500)},
                   "required": [f"k{i}" for i in range(1500)]}
    bodies: list[tuple[str, str, object]] = [
        ("tools_required", CHAT, _chat(tools=many_tools, tool_choice="required")),
        ("tools_auto", CHAT, _chat(tools=many_tools)),
        ("guided_choice", CMPL, _cmpl(guided_choice=many_choices)),
        ("structured_choice", CHAT, _chat(structured_outputs={"choice": many_choices})),
        ("template_multiply", CHAT, _chat(chat_template="{{ 'x' * 10000000 }}")),
        ("template_loops", CHAT, _chat(chat_template=(
            "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}"))),
        ("template_kwargs", CHAT, _chat(chat_template_kwargs={"x": "y" * 1000})),
        ("many_prompts", CMPL, _cmpl(prompt=many_prompts)),
        ("many_prompts_n", CMPL, _cmpl(prompt=many_prompts[:200], n=128)),
        ("many_messages", CHAT, {**_chat(), "messages": many_messages}),
        ("deep_schema", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
            "name": "deep", "schema": _nested_schema(60)}})),
        ("wide_schema", CMPL, _cmpl(guided_json=wide_schema, max_tokens=4)),
        ("regex_catastrophic", CMPL, _cmpl(guided_regex="(a+)+(b+)+(c+)+" * 200)),
        ("regex_repeat", CMPL, _cmpl(guided_regex="[a-z]{1,60000}")),
        ("grammar_big", CMPL, _cmpl(guided_grammar="root ::= " + " | ".join(f'"w{i}"' for i in range(5000)))),
        ("stop_many", CMPL, _cmpl(stop=["s"] * 5000)),
        ("stop_long", CMPL, _cmpl(stop=["s" * 60000])),
        ("logit_bias_many", CMPL, _cmpl(logit_bias={str(i): 1 for i in range(5000)})),
        ("prompt_logprobs", CMPL, _cmpl(prompt_logprobs=5)),
        ("n_max", CMPL, _cmpl(n=128, max_tokens=1)),
        ("tokenize_template", "/tokenize", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                                            "chat_template": "{{ 'x' * 10000000 }}"}),
    ]
    out = []
    for name, path, body in bodies:
        raw = json.dumps(body).encode()
        assert len(raw) <= MAX_REQUEST_BODY, (name, len(raw))
        out.append((name, path, raw, "application/json"))
    out.append(("text_plain", CHAT, json.dumps(_chat()).encode(), "text/plain"))
    out.append(("form", CMPL, b"prompt=hi&max_tokens=2", "application/x-www-form-urlencoded"))
    return out


def _schemathesis_cases(server) -> list[tuple[str, str, str, bytes | None]]:
    """(name, method, path, raw JSON body or None) from the server's OpenAPI schema."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    spec = httpx.get(server.url("/openapi.json"), headers=server.headers, timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    cases: list = []

    def collector(mode: GenerationMode):
        def collect(case) -> None:
            has_body = type(case.body).__name__ != "NotSet"  # schemathesis's marker for "no body"
            body = None
            if has_body and case.method.upper() in ("POST", "PUT", "PATCH"):
                payload = case.body
                if isinstance(payload, dict) and mode == GenerationMode.POSITIVE:
                    # Valid requests may ask for long generations: keep them short.
                    payload = {**payload, "max_tokens": 2}
                    payload.pop("max_completion_tokens", None)
                body = payload if isinstance(payload, bytes) else json.dumps(payload, allow_nan=True).encode()
            cases.append((f"schemathesis {mode.value}", case.method.upper(), case.formatted_path, body))

        return collect

    for op in (op.ok() for op in schema.get_all_operations()):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run = settings(max_examples=SCHEMA_EXAMPLES, deadline=None, database=None, derandomize=True,
                           phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))(
                given(case=op.as_strategy(generation_mode=mode))(collector(mode)))
            try:
                run()
            except Exception as e:  # a negative strategy that cannot be built for this operation
                if "Unsatisfiable" not in type(e).__name__:
                    raise
    return cases


_PROBE_SCRIPT = """
import sys, time, httpx
url, every, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
with httpx.Client(timeout=10.0) as client, open(out, "w", buffering=1) as f:
    while True:
        start = time.perf_counter()
        try:
            status = client.get(url).status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        f.write(f"{time.perf_counter() - start} {status}\\n")
        time.sleep(every)
"""


class _HealthProbe:
    """GET /health every HEALTH_EVERY_S from a process of its own (the senders' threads share this
    one's GIL, which would time them, not the server); every latency and non-200 answer."""

    def __init__(self, url: str, log_path: str) -> None:
        self.log_path = log_path
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._process = subprocess.Popen([sys.executable, "-c", _PROBE_SCRIPT, url, str(HEALTH_EVERY_S), log_path])

    def stop(self) -> None:
        self._process.kill()
        self._process.wait()
        with open(self.log_path) as f:
            for line in f:
                parts = line.split()
                if len(parts) != 2:
                    continue  # the line being written when it was stopped
                self.latencies.append(float(parts[0]))
                if parts[1] != "200":
                    self.failures.append(parts[1])


def _server_rss_kib(server) -> int:
    """The server's, its engine core's and the engine's children's (grammar compilers) RSS."""
    pids = [server.proc.pid, server.engine_pid, *children_of(server.engine_pid)]
    total = 0
    for pid in pids:
        try:
            total += rss_kib(pid)
        except OSError:  # a compiler that just exited
            pass
    return total


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@pytest.mark.serial
@pytest.mark.slow
def test_hostile_fuzz_tier(fuzz_server, tmp_path):
    server = fuzz_server
    rss_start = _server_rss_kib(server)
    hostile = _hostile_bodies()
    generated = _schemathesis_cases(server)
    plan = [(name, method, path, raw, "application/json") for name, method, path, raw in generated]
    for i in range(max(0, REQUESTS - len(plan))):
        name, path, raw, content_type = hostile[i % len(hostile)]
        plan.append((name, "POST", path, raw, content_type))
    random.Random(0).shuffle(plan)
    plan = plan[:REQUESTS]

    statuses: collections.Counter = collections.Counter()
    slowest: dict[str, float] = {}
    problems: list[str] = []
    local = threading.local()
    lock = threading.Lock()

    def send(item) -> None:
        name, method, path, raw, content_type = item
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120.0)
        headers = {"content-type": content_type} if raw is not None else {}
        start = time.perf_counter()
        try:
            r = client.request(method, path, content=raw, headers=headers)
        except httpx.HTTPError as e:
            with lock:
                problems.append(f"{name} {method} {path}: {e!r}")
            return
        problem = None
        if r.status_code >= 500:
            problem = f"{r.status_code}: {r.text[:200]}"
        elif r.status_code >= 400 and path != "/openapi.json":
            try:
                check_error_body_for(path, r.json())
            except (AssertionError, ValueError) as e:
                problem = f"{r.status_code} not the route's error format ({e}): {r.text[:200]}"
        with lock:
            kind = name.split()[0]
            slowest[kind] = max(slowest.get(kind, 0.0), time.perf_counter() - start)
            statuses[f"{name} {r.status_code // 100 if name.startswith('schemathesis') else r.status_code}"] += 1
            if problem:
                problems.append(f"{name} {method} {path} -> {problem}")

    probe = _HealthProbe(server.url("/health"), str(tmp_path / "health.log"))
    time.sleep(1.0)  # the probe's interpreter is up before the first request
    started = time.monotonic()
    rss_peak = rss_start
    try:
        with ThreadPoolExecutor(CLIENT_THREADS) as pool:
            for i, _ in enumerate(pool.map(send, plan)):
                if i % 100 == 0:
                    rss_peak = max(rss_peak, _server_rss_kib(server))
    finally:
        probe.stop()
    seconds = time.monotonic() - started
    stats = wait_idle(server, timeout_s=60.0)
    rss_end = _server_rss_kib(server)
    with server.client() as client:
        assert client.post("/internal/check_integrity").json() == {"ok": True}

    latencies = probe.latencies
    FIGURES["hostile_fuzz"] = {
        "requests": len(plan), "seconds": round(seconds, 1), "generated_cases": len(generated),
        "health_probes": len(latencies), "health_ms": {q: round(1000 * _percentile(latencies, p), 1)
                                                      for q, p in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))},
        "rss_mib": {"start": rss_start // 1024, "peak": rss_peak // 1024, "end": rss_end // 1024},
        "statuses": dict(sorted(statuses.items())),
        "slowest_s": {kind: round(seconds, 2) for kind, seconds in sorted(slowest.items())},
    }
    print(json.dumps(FIGURES["hostile_fuzz"], indent=1))
    assert not problems, "\n".join(problems[:30])
    assert not probe.failures, probe.failures[:10]
    assert len(latencies) >= seconds / (HEALTH_EVERY_S + HEALTH_LIMIT_S) * 0.5
    ordered = sorted(latencies)
    assert ordered[int(0.99 * (len(ordered) - 1))] <= HEALTH_LIMIT_S, FIGURES["hostile_fuzz"]["health_ms"]
    assert ordered[-1] <= HEALTH_WORST_S, FIGURES["hostile_fuzz"]["health_ms"]
    assert rss_peak - rss_start < RSS_GROWTH_LIMIT_KIB, FIGURES["hostile_fuzz"]["rss_mib"]
    assert stats["num_used_blocks"] == 0, stats
