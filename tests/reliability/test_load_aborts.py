"""Load with aborts (issue 7, item 4), then kill -9 under load (item 5) on the same server.

32 concurrent clients stream completions for a bounded time against load_server, whose KV pool
(conftest.LOAD_KV_BLOCKS blocks) is far smaller than 32 requests need, so the scheduler preempts.
About 20% of requests are abandoned by the client: closed after a random number of chunks or a
random delay, or given a read timeout short enough to fire mid-stream. Then:

    lost   0   every request that got headers ended with a final chunk and [DONE], a full body,
               or an explicit error (unless the client itself walked away)
    hung   0   every request ended within HUNG_S
    5xx    0
    KV     0 blocks in use once idle, check_integrity passes, preemptions > 0
    greedy every completed greedy request equals the same request run alone (offline LLM)

Figures (requests sent, lost, hung, 5xx, aborted, RSS growth of both processes) go to the summary.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field

import httpx
import pytest
from rel_helpers import FIGURES, MODEL_NAME, children_of, pid_alive, rss_kib, sse_events, wait_for, wait_idle

CMPL = "/v1/completions"
NUM_CLIENTS = 32
DEFAULT_DURATION_S = float(os.environ.get("KVTIDE_LOAD_SECONDS", "60"))
LONG_DURATION_S = 150.0
HUNG_S = 120.0
ABORT_FRACTION = 0.2

_PREFIXES = ["You are a helpful assistant. Answer briefly and well. ",
             "Once upon a time, in a land of paged caches and ",
             "def schedule(requests, budget):\n    # token budget scheduler\n",
             "The quick brown fox jumps over the lazy dog, again and again, "]
_SUFFIXES = ["Q: what is a block table?", "and so the story goes on", "    return", "until the end"]
# (prompt, max_tokens): shared prefixes exercise the prefix cache under preemption.
PROMPTS = [(p * (1 + i % 2) + s, [8, 24, 48, 64][(i + j) % 4])
           for i, p in enumerate(_PREFIXES) for j, s in enumerate(_SUFFIXES)]


@dataclass
class Outcome:
    kind: str
    """normal | stream-abort | read-timeout | sampled | nonstream"""
    status: int | None = None
    got_headers: bool = False
    done: bool = False
    finish_reason: str | None = None
    error_event: dict | None = None
    text: str = ""
    client_abort: bool = False
    hung: bool = False
    transport_error: str | None = None
    prompt_index: int = 0
    greedy: bool = True
    extra: dict = field(default_factory=dict)


async def _one_request(client: httpx.AsyncClient, rng: random.Random, index: int) -> Outcome:
    prompt, max_tokens = PROMPTS[index]
    r = rng.random()
    if r < ABORT_FRACTION / 2:
        kind = "stream-abort"
    elif r < ABORT_FRACTION:
        kind = "read-timeout"
    elif r < ABORT_FRACTION + 0.1:
        kind = "nonstream"
    elif r < ABORT_FRACTION + 0.25:
        kind = "sampled"
    else:
        kind = "normal"
    out = Outcome(kind, prompt_index=index, greedy=kind != "sampled")
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": kind != "nonstream",
            "temperature": 0.8 if kind == "sampled" else 0.0, "seed": rng.randrange(1 << 30)}
    timeout = httpx.Timeout(HUNG_S, read=rng.uniform(0.005, 0.15)) if kind == "read-timeout" else \
        httpx.Timeout(HUNG_S)
    abort_after_chunks = rng.randrange(0, 12) if kind == "stream-abort" else None
    abort_after_s = rng.uniform(0.0, 3.0) if kind == "stream-abort" and rng.random() < 0.5 else None
    if abort_after_s is not None:
        abort_after_chunks = None
    try:
        coro = _run(client, body, timeout, out, abort_after_chunks)
        if abort_after_s is not None:
            try:
                await asyncio.wait_for(coro, abort_after_s)
            except asyncio.TimeoutError:
                out.client_abort = True
        else:
            await asyncio.wait_for(coro, HUNG_S)
    except asyncio.TimeoutError:
        out.hung = True
    except httpx.TimeoutException:
        if kind == "read-timeout":
            out.client_abort = True
        else:
            out.hung = True
    except httpx.TransportError as e:
        out.transport_error = f"{type(e).__name__}: {e}"
    except Exception as e:  # e.g. an event that is not JSON: counted as lost, the run goes on
        out.transport_error = f"{type(e).__name__}: {e}"
    return out


async def _run(client: httpx.AsyncClient, body: dict, timeout: httpx.Timeout, out: Outcome,
               abort_after_chunks: int | None) -> None:
    if not body["stream"]:
        r = await client.post(CMPL, json=body, timeout=timeout)
        out.status, out.got_headers = r.status_code, True
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            out.text, out.finish_reason, out.done = choice["text"], choice["finish_reason"], True
        else:
            out.error_event = r.json()
        return
    async with client.stream("POST", CMPL, json=body, timeout=timeout) as r:
        out.status, out.got_headers = r.status_code, True
        if r.status_code != 200:
            out.error_event = json.loads(await r.aread())
            return
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out.done = True
                return
            event = json.loads(data)
            if "error" in event:
                out.error_event = event
                continue
            for choice in event["choices"]:
                out.text += choice["text"]
                out.finish_reason = choice["finish_reason"] or out.finish_reason
            chunks += 1
            if abort_after_chunks is not None and chunks >= abort_after_chunks:
                out.client_abort = True
                return


async def _drive(server, duration_s: float, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    deadline = time.monotonic() + duration_s
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=NUM_CLIENTS * 2, max_keepalive_connections=NUM_CLIENTS)
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, limits=limits) as client:
        async def worker(wid: int) -> None:
            wrng = random.Random(rng.random())
            while time.monotonic() < deadline:
                outcomes.append(await _one_request(client, wrng, wrng.randrange(len(PROMPTS))))

        await asyncio.gather(*(worker(i) for i in range(NUM_CLIENTS)))
    return outcomes


def _load_run(server, reference, duration_s: float, seed: int) -> dict:
    expected = {i: reference.greedy(p, n) for i, (p, n) in enumerate(PROMPTS)}
    pids = {"api": server.proc.pid, "engine": server.engine_pid}
    rss_before = {name: rss_kib(pid) for name, pid in pids.items()}
    preempt_before = server.stats()["num_preemptions"]
    started = time.monotonic()
    outcomes = asyncio.run(_drive(server, duration_s, seed))
    elapsed = time.monotonic() - started
    stats = wait_idle(server, timeout_s=60.0)
    rss_after = {name: rss_kib(pid) for name, pid in pids.items()}
    integrity = httpx.post(server.url("/internal/check_integrity"), headers=server.headers, timeout=30).json()

    lost, mismatched = [], []
    for o in outcomes:
        if o.got_headers and not o.client_abort and not o.hung:
            ended = o.done and (o.finish_reason is not None or o.error_event is not None) or \
                (o.status != 200 and o.error_event is not None)
            if not ended:
                lost.append(o)
        if o.transport_error and not o.client_abort:
            lost.append(o)
        if o.greedy and o.done and o.status == 200 and not o.client_abort and o.error_event is None:
            text, finish, _ = expected[o.prompt_index]
            if (o.text, o.finish_reason) != (text, finish):
                mismatched.append((o.prompt_index, o.kind, o.text, text, o.finish_reason, finish))
    kinds = collections.Counter(o.kind for o in outcomes)
    figures = {
        "seconds": round(elapsed, 1), "clients": NUM_CLIENTS, "sent": len(outcomes),
        "completed": sum(1 for o in outcomes if o.done and o.error_event is None and not o.client_abort),
        "aborted_by_client": sum(1 for o in outcomes if o.client_abort),
        "explicit_errors": sum(1 for o in outcomes if o.error_event is not None),
        "lost": len(lost), "hung": sum(1 for o in outcomes if o.hung),
        "5xx": sum(1 for o in outcomes if o.status is not None and o.status >= 500),
        "greedy_compared": sum(1 for o in outcomes if o.greedy and o.done and o.status == 200
                               and not o.client_abort and o.error_event is None),
        "greedy_mismatched": len(mismatched), "kinds": dict(kinds),
        "preemptions": stats["num_preemptions"] - preempt_before, "used_blocks_after": stats["num_used_blocks"],
        "rss_growth_mib": {k: round((rss_after[k] - rss_before[k]) / 1024, 1) for k in pids},
        "rss_after_mib": {k: round(rss_after[k] / 1024, 1) for k in pids},
    }
    assert figures["hung"] == 0, figures
    assert not lost, (figures, [vars(o) for o in lost[:5]])
    assert figures["5xx"] == 0, figures
    assert not mismatched, (figures, mismatched[:5])
    assert figures["explicit_errors"] == 0, (figures, [o.error_event for o in outcomes if o.error_event][:5])
    assert stats["num_used_blocks"] == 0 and integrity == {"ok": True}, (stats, integrity)
    assert figures["preemptions"] > 0, figures
    assert figures["aborted_by_client"] > 0 and figures["greedy_compared"] > 0, figures
    # Not a leak detector (allocator caches grow early), a guard against a gross one.
    assert all(v < 512 for v in figures["rss_growth_mib"].values()), figures
    return figures


def test_load_with_aborts(load_server, reference):
    FIGURES["load"] = _load_run(load_server, reference, DEFAULT_DURATION_S, seed=7)


@pytest.mark.slow
def test_load_with_aborts_long(load_server, reference):
    FIGURES["load_long"] = _load_run(load_server, reference, LONG_DURATION_S, seed=8)


@pytest.mark.serial
def test_kill_9_under_load(load_server):
    """kill -9 of the engine core with 8 streams in flight: /health 503 within 2 s, every stream
    ends with an error event and [DONE], the server exits non-zero, no process is left."""
    server = load_server
    body = {"model": MODEL_NAME, "prompt": "kill me", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0}

    async def stream_all(started: asyncio.Event, count: int) -> list[list]:
        seen = 0

        async def one(client: httpx.AsyncClient) -> list:
            nonlocal seen
            lines = []
            async with client.stream("POST", CMPL, json=body, timeout=60.0) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and not lines:
                        seen += 1
                        if seen == count:
                            started.set()
                    lines.append(line)
            return sse_events(lines)

        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers) as client:
            return await asyncio.gather(*(one(client) for _ in range(count)))

    async def scenario() -> tuple[float, list[list]]:
        started = asyncio.Event()
        task = asyncio.ensure_future(stream_all(started, 8))
        await asyncio.wait_for(started.wait(), 60)
        children.extend(children_of(server.proc.pid))
        os.kill(server.engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        async with httpx.AsyncClient() as probe:
            while (await probe.get(server.url("/health"), timeout=2.0)).status_code != 503:
                await asyncio.sleep(0.02)
        to_unhealthy = time.monotonic() - killed
        return to_unhealthy, await asyncio.wait_for(task, 30)

    children: list[int] = []
    to_unhealthy, streams = asyncio.run(scenario())
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["error"]["code"] == "engine_dead", events[-2]
    server.proc.wait(30)
    assert server.proc.returncode not in (0, None)
    assert server.engine_pid in children
    wait_for(lambda: not any(pid_alive(p) for p in children), 10, "the server's children to be gone")
    FIGURES.setdefault("faults", {})["kill_9"] = {"streams": 8, "seconds_to_unhealthy": round(to_unhealthy, 3)}
    assert to_unhealthy < 2.0
