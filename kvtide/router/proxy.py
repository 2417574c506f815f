"""Relaying one request to a backend the policy picks, with retries, and back to the client.

    choose backend ──▶ send ──▶ 503 (draining) or connection error ──▶ eject it, next backend
                         │        (streamed: also until the first chunk arrived; nothing has
                         │         reached the client yet, so the retry is invisible)
                         └──▶ any other answer ──▶ relayed as it is (stream chunk by chunk)

At most one attempt per backend of the pool. The in-flight count of a backend covers the whole
relay, to the last byte of a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvtide.router.backends import Backend
from kvtide.router.errors import error_response
from kvtide.router.policies import CacheAware, Policy
from kvtide.router.prompt_text import AnswerCollector, answer_text
from kvtide.router.state import RouterState

logger = logging.getLogger("kvtide.router")

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
               "transfer-encoding", "upgrade", "host", "content-length"}
_NOT_RELAYED_BACK = _HOP_BY_HOP | {"server", "date", "x-request-id"}
DISCONNECT_POLL_S = 0.25
"""How often a non-streamed request checks whether its client went away."""

T = TypeVar("T")


@dataclass
class Upstream:
    """An answer a backend started: the response (body not read yet) and, for a streamed 200,
    the first chunk, read before the client got anything so a failure up to there is retried."""

    backend: Backend
    response: httpx.Response
    first_chunk: bytes = b""
    chunks: AsyncIterator[bytes] | None = None
    started: float = field(default_factory=time.perf_counter)
    first_byte_at: float | None = None
    finished: bool = False
    on_answer: Callable[[str], None] | None = None
    """Told the answer's text once a 200 was relayed whole (the cache-aware index records it)."""


@dataclass
class Failure:
    """No backend gave an answer worth relaying: the router's error, or the last 503 a draining
    backend gave (relayed as it is)."""

    response: Response


def backend_headers(request: Request, request_id: str, backend_api_key: str | None) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
    headers["x-request-id"] = request_id
    if backend_api_key is not None:
        headers.pop("x-api-key", None)
        headers["authorization"] = f"Bearer {backend_api_key}"
    return headers


def client_headers(response: httpx.Response, request_id: str) -> dict[str, str]:
    headers = {k: v for k, v in response.headers.items() if k.lower() not in _NOT_RELAYED_BACK}
    headers["x-request-id"] = request_id
    return headers


async def open_upstream(state: RouterState, policy: Policy, path: str, content: bytes, headers: dict[str, str],
                        prompt_text: str, *, stream: bool, timeout: float, retry_server_errors: bool = False,
                        retry_reason: str | None = None) -> Upstream | Failure:
    """Send to backends in turn until one answers something to relay (see the module docstring).
    `retry_server_errors` (prefill requests) also moves on after a timeout or any 5xx."""
    tried: set[Backend] = set()
    pending_retry: str | None = None
    last_failure: Failure | None = None
    for _ in range(max(1, len(policy.pool))):
        choice = policy.choose(prompt_text, tried)
        if choice is None:
            break
        if pending_retry is not None:
            state.metrics.retries.labels(reason=retry_reason or pending_retry).inc()
        if choice.matched_ratio is not None:
            state.metrics.decisions.labels(decision="prefix_match" if choice.by_prefix else "load").inc()
            state.metrics.match_ratio.observe(choice.matched_ratio)
        backend = choice.backend
        tried.add(backend)
        try:
            outcome = await _attempt(state, backend, path, content, headers, stream, timeout, retry_server_errors)
        except _Answer as answer:
            return answer.failure
        if isinstance(outcome, Upstream):
            if isinstance(policy, CacheAware):
                outcome.on_answer = lambda answer, b=backend: policy.record_answer(b, prompt_text,
                                                                                  answer_text(path, answer))
            return outcome
        pending_retry, last_failure = outcome
    if last_failure is not None:
        return last_failure
    return Failure(error_response(f"no healthy backend for {path}", 503, code="no_healthy_backend"))


async def _attempt(state: RouterState, backend: Backend, path: str, content: bytes, headers: dict[str, str],
                   stream: bool, timeout: float, retry_server_errors: bool) -> Upstream | tuple[str, Failure]:
    """One try on one backend: an Upstream to relay, or (retry reason, what to answer if no retry)."""
    state.begin(backend)
    response: httpx.Response | None = None
    handed_over = False
    try:
        request = state.http.build_request("POST", backend.url + path, content=content, headers=headers,
                                           timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)))
        started = time.perf_counter()
        response = await state.http.send(request, stream=True)
        status = response.status_code
        if status == 503 or (retry_server_errors and status >= 500):
            body = await response.aread()
            if status == 503:
                state.eject(backend, "answered 503 (draining or overloaded)")
            state.metrics.requests.labels(backend=backend.url, status=str(status)).inc()
            relayed = Response(body, status_code=status, headers=client_headers(response, headers["x-request-id"]))
            return ("draining" if status == 503 else "server_error"), Failure(relayed)
        upstream = Upstream(backend, response, started=started)
        if stream and status == 200:
            upstream.chunks = response.aiter_raw()
            upstream.first_chunk = await anext(upstream.chunks, b"")
        else:
            await response.aread()  # here, so that a backend failing mid-answer is retried too
        upstream.first_byte_at = time.perf_counter()
        handed_over = True
        return upstream
    except httpx.TransportError as e:  # timeouts included
        if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
            return _timed_out(state, backend, timeout, e, retry_server_errors)
        # Refused, reset, unreachable, or the backend vanished mid-answer: it takes nothing new
        # until its /health answers 200 again.
        state.eject(backend, f"connection error: {type(e).__name__}")
        state.metrics.requests.labels(backend=backend.url, status="error").inc()
        return "connection_error", Failure(error_response(f"backend connection failed ({type(e).__name__})", 502,
                                                          code="backend_unreachable"))
    finally:
        if not handed_over:
            backend.in_flight -= 1
            state.metrics.in_flight.labels(backend=backend.url).set(backend.in_flight)
            if response is not None:
                with anyio.CancelScope(shield=True):
                    await response.aclose()


def _timed_out(state: RouterState, backend: Backend, timeout: float, e: Exception,
               retry_server_errors: bool) -> tuple[str, Failure]:
    """A backend that answers too slowly is not ejected (it may only be busy); the request is
    retried elsewhere only where `retry_server_errors` says so (prefill), else answered 504."""
    state.metrics.requests.labels(backend=backend.url, status="timeout").inc()
    failure = Failure(error_response(f"backend timed out after {timeout:g} s ({type(e).__name__})", 504,
                                     code="backend_timeout"))
    if retry_server_errors:
        return "timeout", failure
    raise _Answer(failure) from e


class _Answer(Exception):
    """Raised out of a retry loop with the response to give (a timeout is not retried)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__("answer")
        self.failure = failure


async def relay(state: RouterState, upstream: Upstream, request_id: str) -> Response:
    """The client's response from an opened Upstream; the backend's in-flight count ends with it."""
    response = upstream.response
    headers = client_headers(response, request_id)
    if upstream.chunks is None:  # a non-streamed answer, or an error answer to a stream: read already
        await finish(state, upstream, response.status_code)
        if upstream.on_answer is not None and response.status_code == 200:
            collector = AnswerCollector()
            collector.feed_json(response.content)
            upstream.on_answer(collector.text)
        return Response(response.content, status_code=response.status_code, headers=headers)
    return _RelayedStream(state, upstream, status_code=response.status_code, headers=headers)


class _RelayedStream(StreamingResponse):
    """A StreamingResponse that ends the upstream however it ends: done, failed, or cancelled
    before its first chunk was sent."""

    def __init__(self, state: RouterState, upstream: Upstream, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(_stream_body(state, upstream), status_code=status_code, headers=headers)
        self._state, self._upstream = state, upstream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await finish(self._state, self._upstream, "client_disconnected")


async def _stream_body(state: RouterState, upstream: Upstream) -> AsyncIterator[bytes]:
    """Chunks as they come. Cancelled when the client goes away (Starlette watches for that):
    closing the upstream response then closes its connection, and the backend aborts the request."""
    status: int | str = upstream.response.status_code
    collector = AnswerCollector() if upstream.on_answer is not None else None
    try:
        if upstream.first_chunk:
            if collector is not None:
                collector.feed_sse(upstream.first_chunk)
            yield upstream.first_chunk
        assert upstream.chunks is not None
        async for chunk in upstream.chunks:
            if collector is not None:
                collector.feed_sse(chunk)
            yield chunk
        if collector is not None and upstream.on_answer is not None:
            upstream.on_answer(collector.text)
    except httpx.HTTPError as e:
        # Too late to retry: bytes reached the client. End the stream; the client sees no [DONE].
        logger.warning("backend %s failed mid-stream: %s", upstream.backend.url, type(e).__name__)
        status = "error"
    except BaseException:
        status = "client_disconnected"
        raise
    finally:
        await finish(state, upstream, status)


async def finish(state: RouterState, upstream: Upstream, status: int | str) -> None:
    """End an upstream once: its backend's in-flight count, its status in the metrics, its
    connection (shielded: this runs in cancelled tasks too)."""
    if upstream.finished:
        return
    upstream.finished = True
    state.end(upstream.backend, status)
    with anyio.CancelScope(shield=True):
        await upstream.response.aclose()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (and so its upstream call) if the client disconnects first;
    None then."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
    finally:
        if not task.done():
            task.cancel()
