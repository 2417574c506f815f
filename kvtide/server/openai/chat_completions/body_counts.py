"""A chat body's tools and messages counted on its raw bytes, before FastAPI parses it: parsing
20,000 small tool objects holds the event loop (and so /health) for most of a second, and the
limits would refuse them anyway.

msgspec skips over each element (`Raw`) instead of building it, so counting a 4 MiB body takes
milliseconds. A body this cannot read (not JSON, fields of the wrong type) is left to the
validation that follows, which words those errors.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute

from kvtide.server import limits
from kvtide.server.errors import OpenAIError
from kvtide.server.state import get_state


class _Counts(msgspec.Struct):
    tools: list[msgspec.Raw] | None = None
    messages: list[msgspec.Raw] | None = None


_decoder = msgspec.json.Decoder(_Counts)


def check_counts(tools: int | None, messages: int | None, max_tools: int) -> None:
    """400 naming the field when a chat request has more tools or messages than allowed."""
    if tools is not None and tools > max_tools:
        raise OpenAIError(f"tools: at most {max_tools} tools, got {tools}", 400, param="tools")
    if messages is not None and messages > limits.MAX_MESSAGES:
        raise OpenAIError(f"messages: at most {limits.MAX_MESSAGES} messages, got {messages}", 400,
                          param="messages")


def check_raw_body(body: bytes, max_tools: int) -> None:
    try:
        counts = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return
    check_counts(None if counts.tools is None else len(counts.tools),
                 None if counts.messages is None else len(counts.messages), max_tools)


class CountedChatRoute(APIRoute):
    """The chat route, its body counted (check_raw_body) before FastAPI parses and validates it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def counted(request: Request) -> Response:
            # Read once: the handler gets the cached bytes.
            check_raw_body(await request.body(), get_state(request).limits.max_tools)
            return await handler(request)

        return counted
