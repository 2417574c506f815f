"""/v1/responses: input items -> chat messages -> one chat turn -> output items, as JSON or as
OpenAI's typed SSE events.

    response.created, response.in_progress
    per output item: response.output_item.added, (response.content_part.added, text deltas,
        text done, response.content_part.done | arguments deltas, arguments done),
        response.output_item.done
    response.completed (response.incomplete when max_output_tokens cut the answer)

Every event carries a sequence_number counting from 0. An error after the stream began is an
"error" event, and the stream ends there.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtide.server.errors import OpenAIError, from_engine_error
from kvtide.server.openai.chat_turn import ChatTurn, chat_request, start_turn
from kvtide.server.openai.common import ClientDisconnected, sse, until_disconnected
from kvtide.server.openai.responses.conversation import (
    chat_messages,
    chat_tool_fields,
    input_items,
    response_format,
)
from kvtide.server.openai.responses.output_items import OutputItems
from kvtide.server.openai.responses.protocol import ResponsesRequest
from kvtide.server.state import ServerState

CHAT_PARAMS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens",
               "max_completion_tokens": "max_output_tokens"}
"""Chat's name of a field -> this API's, for errors the chat machinery raises."""


def rename_param(error: OpenAIError) -> OpenAIError:
    error.param = CHAT_PARAMS.get(error.param or "", error.param)
    return error


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, param=param,
                       code="previous_response_not_found" if param else "not_found")


class ResponsesServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        state = self.state
        model = state.check_model(request.model)
        if request.background:
            raise OpenAIError("background responses are not supported", 400, param="background")
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = state.response_store.get(request.previous_response_id) \
                if state.settings.enable_response_storage else None
            if stored is None:
                raise not_found(request.previous_response_id, "previous_response_id")
            history = stored.conversation
        conversation = history + input_items(request)
        fields = {"messages": chat_messages(conversation, request.instructions),
                  "max_completion_tokens": request.max_output_tokens, "temperature": request.temperature,
                  "top_p": request.top_p, "top_k": request.top_k, "min_p": request.min_p,
                  "repetition_penalty": request.repetition_penalty, "seed": request.seed, "priority": request.priority,
                  "cache_salt": request.cache_salt, "chat_template": request.chat_template,
                  "chat_template_kwargs": request.chat_template_kwargs, "response_format": response_format(request),
                  "user": request.user, **chat_tool_fields(request)}
        chat = chat_request({name: value for name, value in fields.items() if value is not None})
        response = _Response(request, f"resp_{uuid.uuid4().hex}", model,
                             request.store and state.settings.enable_response_storage, conversation)
        try:
            turn = await start_turn(state, chat, raw_request, response.id)
        except ClientDisconnected:
            return Response(status_code=499)
        if request.stream:
            return StreamingResponse(self._stream(turn, response), media_type="text/event-stream")
        try:
            body = await until_disconnected(raw_request, self._collect(turn, response))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body)

    async def _collect(self, turn: ChatTurn, response: _Response) -> dict[str, Any]:
        items = OutputItems()
        async for delta in turn.deltas():
            items.feed(delta)
        items.finish(_item_status(turn))
        return self._finish(turn, response, items)

    async def _stream(self, turn: ChatTurn, response: _Response) -> AsyncIterator[str]:
        sequence = 0

        def event(payload: dict[str, Any]) -> str:
            nonlocal sequence
            payload["sequence_number"] = sequence
            sequence += 1
            return f"event: {payload['type']}\n" + sse(payload)

        items = OutputItems()
        try:
            started = response.body(items.items, "in_progress")
            yield event({"type": "response.created", "response": started})
            yield event({"type": "response.in_progress", "response": started})
            async for delta in turn.deltas():
                for payload in items.feed(delta):
                    yield event(payload)
            for payload in items.finish(_item_status(turn)):
                yield event(payload)
            body = self._finish(turn, response, items)
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield event({"type": kind, "response": body})
        except Exception as e:
            error = rename_param(from_engine_error(e))
            yield event({"type": "error", "code": error.code or error.error_type, "message": error.message,
                         "param": error.param})
        finally:
            await turn.aclose()

    def _finish(self, turn: ChatTurn, response: _Response, items: OutputItems) -> dict[str, Any]:
        """The final response object (stored, if it is to be)."""
        reasoning = items.reasoning_text
        reasoning_tokens = len(self.state.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        usage = {"input_tokens": turn.num_prompt_tokens,
                 "input_tokens_details": {"cached_tokens": turn.num_cached_tokens, "cache_write_tokens": 0},
                 "output_tokens": turn.num_output_tokens,
                 "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, turn.num_output_tokens)},
                 "total_tokens": turn.num_prompt_tokens + turn.num_output_tokens}
        status = _item_status(turn)
        body = response.body(items.items, status, usage)
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"} \
                if turn.engine_finish_reason == "length" else None
        if response.store:
            self.state.response_store.put(response.id, body, response.conversation + copy.deepcopy(items.items))
        return body


def _item_status(turn: ChatTurn) -> str:
    return "completed" if turn.engine_finish_reason == "stop" else "incomplete"


class _Response:
    """The fields of the response object that the request fixes."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str, store: bool,
                 conversation: list[dict[str, Any]]) -> None:
        self.request = request
        self.id = response_id
        self.model = model
        self.store = store
        self.conversation = conversation
        self.created_at = int(time.time())

    def body(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        request = self.request
        text_format = request.text.format if request.text is not None else None
        tool_choice: Any = request.tool_choice or "auto"
        if not isinstance(tool_choice, str):
            tool_choice = {"type": "function", "name": tool_choice.name}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": None, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "model": self.model,
            "output": copy.deepcopy(output), "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None},
            "store": self.store, "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": text_format.model_dump(exclude_none=True, by_alias=True) if text_format else
                     {"type": "text"}},
            "tool_choice": tool_choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": request.truncation or "disabled", "usage": usage, "user": request.user,
            "metadata": request.metadata or {},
        }
