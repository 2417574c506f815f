"""A minimal OpenAI-compatible stand-in backend (not kvtide) that answers with the headers it
received, run in a thread of the test process: what the router forwards, seen from the other side."""

from __future__ import annotations

import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


async def _completions(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse({"id": "cmpl-echo", "object": "text_completion", "model": body.get("model"),
                         "choices": [{"index": 0, "text": "echo", "finish_reason": "stop"}],
                         "received_headers": dict(request.headers), "received_body": body})


async def _health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


class EchoBackend:
    def __init__(self, port: int) -> None:
        app = Starlette(routes=[Route("/v1/completions", _completions, methods=["POST"]),
                                Route("/health", _health)])
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> EchoBackend:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("echo backend did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
