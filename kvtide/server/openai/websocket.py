"""/v1/chat/completions and /v1/completions as WebSockets (the same paths, `websocket` scope): the
SSE stream of the POST, one message per event.

    client                                        server
    connect (Origin, Host)                        ─▶ a foreign page or Host name: 403/400, no handshake
    connect (Authorization: Bearer K | x-api-key) ─▶ key, drain and quota checks (middleware)
    one text message: the POST's JSON body        ─▶ validated as the POST's, "stream" forced true
                                                  ◀─ per SSE event: the JSON after `data: `
                                                  ◀─ "[DONE]"
                                                  ◀─ close 1000

The body runs through the POST's own serving code (ChatServing / CompletionServing.create), whose
StreamingResponse is relayed event by event, so both transports send the same payloads.

Errors before the stream starts (invalid JSON or fields, unknown model, prompt too long, ...): one
text message with the OpenAI error JSON the POST would answer, then close with 1008 (policy) for a
client error (4xx), 1013 (try again later) for 429 and 503, 1011 (internal error) for any other
5xx. Errors after it started arrive as in the SSE stream: an {"error": ...} message, "[DONE]",
close 1000. A message over --max-request-body is closed with 1009 by the server.

A client that closes mid-stream gets its engine requests aborted, as an SSE client that
disconnects. Messages after the first are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvtide.server.asgi import WS_CLOSE_POLICY, WS_CLOSE_TRY_AGAIN_LATER
from kvtide.server.errors import OpenAIError, from_engine_error
from kvtide.server.openai.chat_completions.body_counts import check_raw_body
from kvtide.server.openai.chat_completions.protocol import ChatCompletionRequest
from kvtide.server.openai.chat_completions.serving import ChatServing
from kvtide.server.openai.completions.protocol import CompletionRequest
from kvtide.server.openai.completions.serving import CompletionServing
from kvtide.server.state import ServerState

WS_CLOSE_NORMAL = 1000
WS_CLOSE_INTERNAL_ERROR = 1011

router = APIRouter()

Create = Callable[[Any, Request], Awaitable[Response]]


@router.websocket("/v1/chat/completions")
async def chat_completion_websocket(websocket: WebSocket) -> None:
    state: ServerState = websocket.app.state.kvtide
    await _serve(websocket, ChatCompletionRequest, lambda state: ChatServing(state).create,
                 lambda body: check_raw_body(body, state.limits.max_tools))


@router.websocket("/v1/completions")
async def completion_websocket(websocket: WebSocket) -> None:
    await _serve(websocket, CompletionRequest, lambda state: CompletionServing(state).create)


async def _serve(websocket: WebSocket, request_type: type[BaseModel],
                 serving: Callable[[ServerState], Create],
                 precheck: Callable[[bytes], None] | None = None) -> None:
    state: ServerState = websocket.app.state.kvtide
    await websocket.accept()
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        return
    try:
        request = _parse(message, request_type, state.settings.max_request_body, precheck)
    except RequestValidationError as e:
        await _close_with_error(websocket, await _handled(websocket, e))
        return
    except OpenAIError as e:
        await _close_with_error(websocket, e)
        return
    disconnected = asyncio.Event()
    watcher = asyncio.ensure_future(_watch_disconnect(websocket, disconnected))
    try:
        try:
            response = await serving(state)(request, _as_request(websocket, disconnected))
        except Exception as e:
            await _close_with_error(websocket, from_engine_error(e))
            return
        if not isinstance(response, StreamingResponse):  # 499: the client left before the first output
            return
        if await _relay(websocket, response.body_iterator, disconnected):
            with contextlib.suppress(Exception):
                await websocket.close(WS_CLOSE_NORMAL)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def _parse(message: dict[str, Any], request_type: type[BaseModel], max_bytes: int,
           precheck: Callable[[bytes], None] | None = None) -> BaseModel:
    """The first message -> the request, as the POST route validates its body (same errors, and the
    route's count of tools and messages on the raw bytes first, so a huge list is not parsed on the
    event loop)."""
    text = message.get("text")
    if text is None:
        try:
            text = (message.get("bytes") or b"").decode("utf-8")
        except UnicodeDecodeError:
            raise OpenAIError("the message must be UTF-8 JSON text", 400, code="invalid_json") from None
    if len(text.encode()) > max_bytes:
        raise OpenAIError(f"Request body exceeds the limit of {max_bytes} bytes (--max-request-body)", 413,
                          code="request_too_large")
    if precheck is not None:
        precheck(text.encode())
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from None
    if not isinstance(body, dict):
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",), "input": body,
                                       "msg": "Input should be a valid dictionary or object to extract fields from"}])
    try:
        return request_type.model_validate({**body, "stream": True})
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in e.errors()]) from None


async def _handled(websocket: WebSocket, exc: Exception) -> OpenAIError:
    """`exc` as the app's exception handler answers it over HTTP, as an OpenAIError."""
    handlers = websocket.app.exception_handlers
    handler = next((handlers[cls] for cls in type(exc).__mro__ if cls in handlers), None)
    if handler is None:
        return from_engine_error(exc)
    response = await handler(websocket, exc)
    error = json.loads(response.body)["error"]
    return OpenAIError(error["message"], response.status_code, param=error.get("param"), code=error.get("code"),
                       error_type=error.get("type"))


def _close_code(error: OpenAIError) -> int:
    if error.status in (429, 503):
        return WS_CLOSE_TRY_AGAIN_LATER
    return WS_CLOSE_INTERNAL_ERROR if error.status >= 500 else WS_CLOSE_POLICY


async def _close_with_error(websocket: WebSocket, error: OpenAIError) -> None:
    with contextlib.suppress(Exception):  # the client may be gone
        await websocket.send_text(json.dumps(error.body()))
        await websocket.close(_close_code(error), reason=(error.code or "")[:120])


async def _watch_disconnect(websocket: WebSocket, disconnected: asyncio.Event) -> None:
    try:
        while (await websocket.receive())["type"] != "websocket.disconnect":
            pass  # messages after the first are ignored
    except Exception:
        pass
    disconnected.set()


def _as_request(websocket: WebSocket, disconnected: asyncio.Event) -> Request:
    """What the serving code gets as its raw request: it only waits on it for http.disconnect."""

    async def receive() -> dict[str, Any]:
        await disconnected.wait()
        return {"type": "http.disconnect"}

    return Request({**websocket.scope, "type": "http", "method": "POST"}, receive=receive)


async def _relay(websocket: WebSocket, body: AsyncIterator[Any], disconnected: asyncio.Event) -> bool:
    """Send each SSE event's payload as a text message; False if the client left first. The stream
    is closed in every case, which aborts its engine requests when they have not finished."""

    async def pump() -> None:
        async for chunk in body:
            for payload in sse_payloads(chunk):
                await websocket.send_text(payload)

    pump_task = asyncio.ensure_future(pump())
    gone_task = asyncio.ensure_future(disconnected.wait())
    try:
        done, _ = await asyncio.wait({pump_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        if pump_task not in done:
            return False
        try:
            pump_task.result()
        except Exception:  # a send failed: the client is gone
            return False
        return True
    finally:
        for task in (pump_task, gone_task):
            task.cancel()
        await asyncio.gather(pump_task, gone_task, return_exceptions=True)
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


def sse_payloads(chunk: str | bytes) -> list[str]:
    """'data: {...}\\n\\n' (one or more events) -> ['{...}']; 'data: [DONE]\\n\\n' -> ['[DONE]']."""
    if isinstance(chunk, bytes):
        chunk = chunk.decode("utf-8")
    payloads = []
    for event in chunk.split("\n\n"):
        lines = [line[5:].removeprefix(" ") for line in event.split("\n") if line.startswith("data:")]
        if lines:
            payloads.append("\n".join(lines))
    return payloads
