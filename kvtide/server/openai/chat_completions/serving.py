"""/v1/chat/completions: messages -> chat template -> one engine request -> JSON or SSE.

The conversation is rendered to text by the chat template (which writes BOS itself) and then
tokenized exactly once with add_special_tokens=False, so the prompt never starts with two BOS.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtide.outputs import CompletionOutput, RequestOutput
from kvtide.server.errors import OpenAIError, from_engine_error, from_value_error
from kvtide.server.openai.chat_completions.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobEntry,
    ChatMessage,
    ChatResponseMessage,
)
from kvtide.server.openai.common import (
    SSE_DONE,
    ClientDisconnected,
    UsageInfo,
    build_sampling_params,
    chosen_logprob,
    first_and_rest,
    merge_streams,
    resolve_max_tokens,
    safe_float,
    sse,
    top_entries,
    until_disconnected,
)
from kvtide.server.state import ServerState


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[ChatLogprobEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def render_chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                       chat_template: str | None = None,
                       template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Messages -> prompt token ids (rendered with the template, tokenized once, no added BOS)."""
    tokenizer = state.tokenizer
    template = chat_template or state.settings.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise OpenAIError("this model has no chat template; start the server with --chat-template", 400,
                          param="messages")
    conversation = [_message_dict(m, i) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except Exception as e:  # jinja2 errors, a template's raise_exception(...)
        raise OpenAIError(f"cannot render the messages with the chat template: {e}", 400,
                          param="messages") from e
    if not isinstance(text, str) or not text:
        raise OpenAIError("the chat template rendered an empty prompt", 400, param="messages")
    return tokenizer.encode(text, add_special_tokens=False)


def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                                  400, param="messages")
            texts.append(part.text)
        content = "".join(texts)
    result: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    return result


class ChatServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        state = self.state
        model = state.check_model(request.model)
        self._check_supported(request)
        prompt_ids = render_chat_prompt(state, request.messages, request.add_generation_prompt,
                                        request.chat_template, request.chat_template_kwargs)
        try:
            prompt_ids = state.engine.process_prompt({"prompt_token_ids": prompt_ids}).prompt_token_ids
        except ValueError as e:
            raise from_value_error(e, param="messages") from e
        requested = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        max_tokens = resolve_max_tokens(requested, len(prompt_ids), state.max_model_len, "messages")
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = build_sampling_params(request, max_tokens, top_logprobs)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = merge_streams([state.engine.generate({"prompt_token_ids": prompt_ids}, params, response_id,
                                                      request.priority)])
        if request.stream:
            try:
                # Until the first output, a client that leaves is noticed here (then by Starlette).
                _, rest = await until_disconnected(raw_request, first_and_rest(stream))
            except ClientDisconnected:
                return Response(status_code=499)
            return StreamingResponse(self._stream(rest, request, response_id, model, len(prompt_ids)),
                                     media_type="text/event-stream")
        try:
            body = await until_disconnected(raw_request,
                                            self._collect(stream, request, response_id, model, len(prompt_ids)))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body)

    @staticmethod
    def _check_supported(request: ChatCompletionRequest) -> None:
        request.check_stream_options()
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", 400, param="top_logprobs")
        if request.tools:
            raise OpenAIError("tools are not supported", 400, param="tools")
        if request.response_format is not None and request.response_format.type != "text":
            raise OpenAIError(f"response_format {request.response_format.type!r} is not supported; only 'text'",
                              400, param="response_format")

    def _logprobs(self, completion: CompletionOutput, k: int) -> list[ChatLogprobEntry]:
        token_text = self.state.token_text
        entries = []
        for token_id, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
            text = token_text(token_id)
            entries.append(ChatLogprobEntry(
                token=text, logprob=safe_float(chosen_logprob(entry, token_id)),
                bytes=list(text.encode("utf-8", errors="replace")),
                top_logprobs=[ChatLogprob(token=token_text(tid), logprob=safe_float(lp.logprob),
                                          bytes=list(token_text(tid).encode("utf-8", errors="replace")))
                              for tid, lp in top_entries(entry, k)]))
        return entries

    # ---- non-streamed ----------------------------------------------------------------------
    async def _collect(self, stream: AsyncIterator[tuple[int, RequestOutput]], request: ChatCompletionRequest,
                       response_id: str, model: str, num_prompt_tokens: int) -> dict[str, Any]:
        choices: dict[int, _Choice] = {}
        cached_tokens = 0
        async for _, output in stream:
            cached_tokens = output.num_cached_tokens
            for completion in output.outputs:
                choice = choices.setdefault(completion.index, _Choice())
                choice.text.append(completion.text)
                choice.num_tokens += len(completion.token_ids)
                if request.logprobs:
                    choice.logprobs = (choice.logprobs or []) + self._logprobs(completion, request.top_logprobs or 0)
                if completion.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        response = ChatCompletionResponse(
            id=response_id, created=int(time.time()), model=model,
            choices=[ChatCompletionChoice(
                index=i, message=ChatResponseMessage(content="".join(c.text)),
                logprobs=ChatChoiceLogprobs(content=c.logprobs) if request.logprobs else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason) for i, c in sorted(choices.items())],
            usage=UsageInfo.of(num_prompt_tokens, sum(c.num_tokens for c in choices.values()), cached_tokens))
        return response.model_dump()

    # ---- streamed --------------------------------------------------------------------------
    async def _stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]], request: ChatCompletionRequest,
                      response_id: str, model: str, num_prompt_tokens: int) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.include_usage_in_stream()

        def chunk(choices: list[dict[str, Any]]) -> str:
            body: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                                    "model": model, "choices": choices}
            if include_usage:
                body["usage"] = None
            return sse(body)

        num_completion_tokens = 0
        cached_tokens = 0
        try:
            # The first chunk of every choice carries the role.
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(request.n)])
            async for _, output in outputs:
                cached_tokens = output.num_cached_tokens
                choices = []
                for completion in output.outputs:
                    num_completion_tokens += len(completion.token_ids)
                    logprobs = None
                    if request.logprobs:
                        entries = self._logprobs(completion, request.top_logprobs or 0)
                        logprobs = {"content": [e.model_dump() for e in entries]}
                    delta = {"content": completion.text} if completion.text else {}
                    choices.append({"index": completion.index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": completion.finish_reason,
                                    "stop_reason": completion.stop_reason})
                yield chunk(choices)
            if include_usage:
                yield sse({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": UsageInfo.of(num_prompt_tokens, num_completion_tokens,
                                                                cached_tokens).model_dump()})
        except Exception as e:
            yield sse(from_engine_error(e).body())
        finally:
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()
        yield SSE_DONE
