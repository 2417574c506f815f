"""Faults (issue 7, item 5): what the server does when the engine misbehaves.

    NaN logits for one request      only that request fails; the others match the offline LLM
    exception in the forward pass   engine dead: /health 503 within 2 s, every stream ends with an
                                    error event and [DONE], the server exits non-zero, no child left
    SIGSTOP of the engine core      the watchdog (--engine-timeout 2) declares it dead: the same
    SIGTERM under load              /health 503 at once; streams still running when
                                    --shutdown-timeout passes end with an error event and [DONE]
(kill -9 under load is in test_load_aborts.py, on the server that load test used.)

Faults are armed through KVTIDE_FAULT_INJECT (kvtide/testing/faults.py) in the servers conftest
starts: token 257 in a prompt gives NaN logits, token 258 raises in the forward pass.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time

import httpx
import pytest
import torch
from rel_helpers import (
    FIGURES,
    MODEL_NAME,
    NAN_TOKEN,
    RAISE_TOKEN,
    check_error_body,
    children_of,
    pid_alive,
    sse_events,
    wait_for,
    wait_idle,
)

from kvtide.testing.faults import FaultInjector, InjectedFault

CMPL = "/v1/completions"


def _body(prompt, max_tokens: int, stream: bool = True, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "temperature": 0,
            **extra}


async def _stream(client: httpx.AsyncClient, body: dict, first_chunk: asyncio.Event | None = None) -> list:
    lines: list[str] = []
    async with client.stream("POST", CMPL, json=body, timeout=120.0) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            lines.append(line)
            if first_chunk is not None and line.startswith("data: "):
                first_chunk.set()
    return sse_events(lines)


def _text(events: list) -> tuple[str, str | None]:
    text, finish = "", None
    for event in events:
        if isinstance(event, dict) and "choices" in event:
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


def _assert_error_then_done(events: list, code: str | None = None) -> dict:
    assert events and events[-1] == "[DONE]", events[-3:]
    error = check_error_body(events[-2])
    if code is not None:
        assert error["code"] == code, error
    return error


async def _faulted(server, num_streams: int, inject, probe_timeout_s: float = 1.0) -> tuple[float, list[list]]:
    """Open num_streams long streams, wait for a chunk of each, call inject(), then time until
    /health answers 503; returns (seconds, the streams' events)."""
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers) as client:
        events = [asyncio.Event() for _ in range(num_streams)]
        tasks = [asyncio.ensure_future(_stream(client, _body(f"stream {i} of the fault", 220, ignore_eos=True), e))
                 for i, e in enumerate(events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        started = time.monotonic()
        await inject(client)
        async with httpx.AsyncClient() as probe:
            while True:
                try:
                    if (await probe.get(server.url("/health"), timeout=probe_timeout_s)).status_code == 503:
                        break
                except httpx.TimeoutException:
                    pass
                await asyncio.sleep(0.02)
        elapsed = time.monotonic() - started
        return elapsed, await asyncio.wait_for(asyncio.gather(*tasks), 60)


def _assert_gone(server, children: list[int], expect_zero_exit: bool = False) -> None:
    server.proc.wait(60)
    if expect_zero_exit:
        assert server.proc.returncode == 0, server.log()[-3000:]
    else:
        assert server.proc.returncode not in (0, None), server.log()[-3000:]
    assert server.engine_pid in children
    wait_for(lambda: not any(pid_alive(p) for p in children), 15, "the server's children to be gone")


def _record(name: str, value: dict) -> None:
    FIGURES.setdefault("faults", {})[name] = value


# ---- the injector itself (no server) --------------------------------------------------------------
def test_fault_injector_spec():
    f = FaultInjector.parse("nan_token=7, raise_after_steps=2;sleep_s=0")
    logits = torch.zeros(3, 5)
    f.on_logits(logits, [[1, 2], [7, 3], [4]])
    assert math.isnan(logits[1, 0]) and torch.isfinite(logits[[0, 2]]).all()
    f.on_logits(torch.zeros(1, 5), [[1]])
    with pytest.raises(InjectedFault, match="after 2 steps"):
        f.on_logits(torch.zeros(1, 5), [[1]])
    with pytest.raises(InjectedFault, match="token 9"):
        FaultInjector.parse("raise_token=9").on_logits(torch.zeros(1, 5), [[9]])
    with pytest.raises(ValueError, match="KVTIDE_FAULT_INJECT"):
        FaultInjector.parse("nan_tokn=7")


# ---- per-request failure ---------------------------------------------------------------------------
def test_nan_logits_fail_only_that_request(fault_server, reference):
    server = fault_server
    good = [("The first healthy request", 24), ("Another healthy one, longer", 40), ("third", 16)]
    bad_prompt = [0, 65, 66, NAN_TOKEN, 67]

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers) as client:
            healthy = [asyncio.ensure_future(_stream(client, _body(p, n))) for p, n in good]
            # The NaN comes at the request's first step, before any output: the stream's error
            # arrives before the headers, as a 500 (an error mid-stream would be an event).
            bad_stream = asyncio.ensure_future(client.post(CMPL, json=_body(bad_prompt, 16), timeout=60))
            bad_plain = await client.post(CMPL, json=_body(bad_prompt, 16, stream=False), timeout=60)
            return await asyncio.gather(*healthy), await bad_stream, bad_plain

    healthy, bad_stream, bad_plain = asyncio.run(scenario())
    for (prompt, n), events in zip(good, healthy, strict=True):
        assert events[-1] == "[DONE]"
        text, finish, _ = reference.greedy(prompt, n)
        assert _text(events) == (text, finish)
    for bad in (bad_stream, bad_plain):
        assert bad.status_code == 500
        error = check_error_body(bad.json())
        assert error["code"] == "engine_error" and "non-finite" in error["message"], error
    # The engine is fine and nothing leaked.
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    stats = wait_for_idle_stats(server)
    assert stats["num_used_blocks"] == 0
    r = httpx.post(server.url(CMPL), headers=server.headers, json=_body("after the NaN", 8, stream=False))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference.greedy("after the NaN", 8)[0]
    _record("nan_logits", {"failed": 2, "healthy_ok": len(good)})


def wait_for_idle_stats(server) -> dict:
    stats = wait_idle(server)
    assert httpx.post(server.url("/internal/check_integrity"), headers=server.headers).json() == {"ok": True}
    return stats


# ---- engine death --------------------------------------------------------------------------------
@pytest.mark.serial
def test_exception_in_forward_pass(fault_server):
    server = fault_server
    children = children_of(server.proc.pid)
    trigger: dict = {}

    async def inject(client: httpx.AsyncClient) -> None:
        # Fails at its first step, before any output: a 503 before headers, not an event.
        trigger["task"] = asyncio.ensure_future(client.post(CMPL, json=_body([0, 70, RAISE_TOKEN], 8), timeout=60))

    async def scenario():
        elapsed, streams = await _faulted(server, 4, inject)
        return elapsed, streams, await asyncio.wait_for(trigger["task"], 30)

    elapsed, streams, trigger_response = asyncio.run(scenario())
    for events in streams:
        error = _assert_error_then_done(events, "engine_dead")
        assert "InjectedFault" in error["message"] and "Traceback" not in error["message"], error
    assert trigger_response.status_code == 503
    assert check_error_body(trigger_response.json())["code"] == "engine_dead"
    assert "InjectedFault" in server.log()
    _assert_gone(server, children)
    _record("forward_exception", {"streams": 5, "seconds_to_unhealthy": round(elapsed, 3)})
    assert elapsed < 2.0


def test_whole_server_paused_past_the_watchdog_timeout_keeps_serving(watchdog_server, reference):
    """SIGSTOP of the API process and the engine core together (what `kvtide bench compare` does to
    an idle server while a peer is measured; a suspended machine): the time the API process was
    stopped is not the engine's silence, so the watchdog must not call it dead once resumed."""
    server = watchdog_server
    pids = [server.proc.pid, server.engine_pid]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(4.0)  # twice --engine-timeout
    finally:
        for pid in reversed(pids):
            os.kill(pid, signal.SIGCONT)
    time.sleep(1.5)  # several watchdog ticks, each of which would have declared it dead
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    r = httpx.post(server.url(CMPL), headers=server.headers, json=_body("after the pause", 8, stream=False))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference.greedy("after the pause", 8)[0]
    assert "unresponsive" not in server.log()


@pytest.mark.serial
def test_sigstop_engine_watchdog(watchdog_server):
    server = watchdog_server
    children = children_of(server.proc.pid)

    async def inject(_client) -> None:
        os.kill(server.engine_pid, signal.SIGSTOP)

    try:
        elapsed, streams = asyncio.run(_faulted(server, 4, inject))
    finally:
        if pid_alive(server.engine_pid):
            os.kill(server.engine_pid, signal.SIGCONT)  # (the server SIGKILLs it; this only unsticks a failure)
    for events in streams:
        error = _assert_error_then_done(events, "engine_dead")
        assert "unresponsive" in error["message"], error
    _assert_gone(server, children)
    _record("sigstop_watchdog", {"streams": 4, "engine_timeout_s": 2, "seconds_to_unhealthy": round(elapsed, 3)})
    assert elapsed < 2.0 + 1.5  # the timeout, plus the watchdog's 0.2 s tick and a loaded machine


@pytest.mark.serial
def test_sigterm_under_load(sigterm_server):
    server = sigterm_server
    children = children_of(server.proc.pid)

    async def inject(_client) -> None:
        server.proc.send_signal(signal.SIGTERM)

    elapsed, streams = asyncio.run(_faulted(server, 6, inject))
    for events in streams:
        _assert_error_then_done(events, "shutting_down")
    _assert_gone(server, children, expect_zero_exit=True)
    assert "shutdown timeout: 6 request(s) still in flight" in server.log()
    _record("sigterm_under_load", {"streams": 6, "shutdown_timeout_s": 1, "seconds_to_unhealthy": round(elapsed, 3)})
    assert elapsed < 2.0
