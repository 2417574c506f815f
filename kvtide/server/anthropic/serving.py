"""/v1/messages: Anthropic's Messages API -> chat messages -> one chat turn -> content blocks, as
JSON or as Anthropic's stream:

    message_start
    per block: content_block_start, content_block_delta (text_delta | thinking_delta |
        input_json_delta) ..., content_block_stop
    message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop

Each event goes with its SSE `event:` name, which Anthropic's clients dispatch on. An error after
the stream began is an "error" event, and the stream ends there.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtide.server.anthropic.content_blocks import ContentBlocks
from kvtide.server.anthropic.conversation import chat_fields
from kvtide.server.anthropic.errors import error_body
from kvtide.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvtide.server.errors import from_engine_error
from kvtide.server.openai.chat_completions.serving import render_chat_prompt
from kvtide.server.openai.chat_completions.tools import plan_tools
from kvtide.server.openai.chat_turn import ChatTurn, chat_request, start_turn
from kvtide.server.openai.common import ClientDisconnected, until_disconnected
from kvtide.server.state import ServerState

CHAT_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


def stop_reason(turn: ChatTurn) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if turn.finish_reason == "tool_calls":
        return "tool_use", None
    if turn.engine_finish_reason == "length":
        return "max_tokens", None
    if isinstance(turn.stop_reason, str):
        return "stop_sequence", turn.stop_reason
    return "end_turn", None


def sse_event(payload: dict[str, Any]) -> str:
    data = json.dumps(payload, ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {data}\n\n"


class MessagesServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, request: MessagesRequest, raw_request: Request) -> Response:
        state = self.state
        model = state.check_model(request.model)
        chat = chat_request(chat_fields(request))
        message_id = f"msg_{uuid.uuid4().hex}"
        try:
            turn = await start_turn(state, chat, raw_request, message_id)
        except ClientDisconnected:
            return Response(status_code=499)
        if request.stream:
            return StreamingResponse(self._stream(turn, message_id, model), media_type="text/event-stream")
        try:
            body = await until_disconnected(raw_request, self._collect(turn, message_id, model))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body)

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, Any]:
        """{"input_tokens": N}: the prompt /v1/messages would run for this body, counted."""
        state = self.state
        state.check_model(request.model)
        fields = chat_fields(request)
        if "tools" in fields:
            fields.setdefault("tool_choice", "none")  # the tools are rendered the same; no parser needed
        chat = chat_request(fields)
        plan = plan_tools(chat, state.parsers.auto_tool_choice, state.limits)
        _, prompt_ids = await render_chat_prompt(state, chat.messages, chat.add_generation_prompt, chat.chat_template,
                                                 chat.chat_template_kwargs, plan.tools)
        prompt_ids = state.engine.process_prompt({"prompt_token_ids": prompt_ids}).prompt_token_ids
        return {"input_tokens": len(prompt_ids)}

    async def _collect(self, turn: ChatTurn, message_id: str, model: str) -> dict[str, Any]:
        blocks = ContentBlocks()
        async for delta in turn.deltas():
            blocks.feed(delta)
        blocks.finish()
        reason, sequence = stop_reason(turn)
        return {**_message(message_id, model, blocks.blocks, reason, sequence), "usage": _usage(turn)}

    async def _stream(self, turn: ChatTurn, message_id: str, model: str) -> AsyncIterator[str]:
        blocks = ContentBlocks()
        try:
            start = {**_message(message_id, model, [], None, None),
                     "usage": {**_usage(turn), "output_tokens": 0}}
            yield sse_event({"type": "message_start", "message": start})
            async for delta in turn.deltas():
                for payload in blocks.feed(delta):
                    yield sse_event(payload)
            for payload in blocks.finish():
                yield sse_event(payload)
            reason, sequence = stop_reason(turn)
            yield sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                             "usage": {"output_tokens": turn.num_output_tokens}})
            yield sse_event({"type": "message_stop"})
        except Exception as e:
            yield sse_event(error_body(from_engine_error(e)))
        finally:
            await turn.aclose()


def _message(message_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
             sequence: str | None) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence}


def _usage(turn: ChatTurn) -> dict[str, Any]:
    return {"input_tokens": turn.num_prompt_tokens, "output_tokens": turn.num_output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": turn.num_cached_tokens}
