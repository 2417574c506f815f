"""/v1/chat/completions: messages -> chat template -> one engine request -> JSON or SSE.

The conversation is rendered to text by the chat template (which writes BOS itself) and then
tokenized exactly once with add_special_tokens=False, so the prompt never starts with two BOS.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtide.outputs import CompletionOutput, RequestOutput
from kvtide.sampling_params import StructuredOutputsParams
from kvtide.server.errors import OpenAIError, from_engine_error, from_value_error
from kvtide.server.limits import MAX_CHAT_TEMPLATE_BYTES, MAX_MESSAGES
from kvtide.server.openai import offload
from kvtide.server.openai.chat_completions.assembly import ChoiceAssembler, assemble_message
from kvtide.server.openai.chat_completions.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobEntry,
    ChatMessage,
    ChatResponseMessage,
    MessageToolCall,
)
from kvtide.server.openai.chat_completions.tools import ToolPlan, plan_tools
from kvtide.server.openai.common import (
    SSE_DONE,
    ClientDisconnected,
    UsageInfo,
    build_sampling_params,
    chosen_logprob,
    first_and_rest,
    merge_streams,
    prompt_logprobs_body,
    resolve_max_tokens,
    response_body,
    safe_float,
    sse,
    top_entries,
    until_disconnected,
)
from kvtide.server.openai.rendering import TemplateRenderError, render_template
from kvtide.server.openai.structured import (
    check_constraint_off_loop,
    constraint_error,
    make_structured_outputs,
    structured_outputs_of,
)
from kvtide.server.output_parsers import SPECIAL_MARKER_TOOL_PARSERS
from kvtide.server.quotas import charge_tokens, charged_outputs
from kvtide.server.state import ServerState


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[ChatLogprobEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


TEMPLATE_RESERVED_KWARGS = frozenset({"messages", "conversation", "documents", "add_generation_prompt", "chat_template",
                                      "tokenize", "continue_final_message", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""chat_template_kwargs that would replace what the server passes the template (or change how
transformers runs it): a 400, as apply_chat_template's TypeError used to be."""


def check_chat_request(state: ServerState, messages: list[ChatMessage], chat_template: str | None,
                       template_kwargs: dict[str, Any] | None) -> None:
    """The limits a chat body must meet before anything is rendered (400s naming the field)."""
    if len(messages) > MAX_MESSAGES:
        raise OpenAIError(f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}", 400, param="messages")
    if chat_template is not None:
        if not state.limits.trust_request_chat_template:
            raise OpenAIError("chat_template in a request is not accepted by this server (it runs code on the "
                              "server); start it with --trust-request-chat-template to allow it", 400,
                              param="chat_template")
        if len(chat_template.encode("utf-8")) > MAX_CHAT_TEMPLATE_BYTES:
            raise OpenAIError(f"chat_template: at most {MAX_CHAT_TEMPLATE_BYTES} bytes", 400, param="chat_template")
    reserved = sorted(TEMPLATE_RESERVED_KWARGS & set(template_kwargs or {}))
    if reserved:
        raise OpenAIError(f"chat_template_kwargs may not set {', '.join(reserved)}", 400,
                          param="chat_template_kwargs")


async def render_chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                             chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                             tools: list[dict[str, Any]] | None = None, check_length: bool = True) -> tuple[str, list[int]]:
    """Messages -> (prompt text, token ids): rendered with the template, tokenized once with no
    added BOS, both off the event loop. check_length: refuse a text too long for max_model_len."""
    text = await render_chat_text(state, messages, add_generation_prompt, chat_template, template_kwargs, tools)
    tokenizer = state.tokenizer

    def encode() -> list[int]:
        if check_length:
            offload.check_prompt_chars(tokenizer, text, state.max_model_len, "messages")
        return tokenizer.encode(text, add_special_tokens=False)

    ids = await offload.tokenize(encode, timeout_s=state.limits.render_timeout_s, param="messages")
    return text, ids


async def render_chat_text(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                           chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                           tools: list[dict[str, Any]] | None = None) -> str:
    """Messages (and the tools, for templates that describe them) -> the prompt text, rendered off
    the event loop within --render-timeout and 2 x --max-request-body bytes (rendering.py)."""
    check_chat_request(state, messages, chat_template, template_kwargs)
    tokenizer = state.tokenizer
    template = chat_template or state.settings.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise OpenAIError("this model has no chat template; start the server with --chat-template", 400,
                          param="messages")
    if not isinstance(template, str):  # a tokenizer's named templates: pick as transformers does
        template = tokenizer.get_chat_template(None, tools or None)
    conversation = [_message_dict(m, i) for i, m in enumerate(messages)]
    kwargs = dict(template_kwargs or {})
    kwargs.pop("tools", None)
    limits = state.limits
    try:
        text = await offload.render(render_template, tokenizer, template, conversation, tools or None,
                                    add_generation_prompt, kwargs, limits.max_rendered_prompt_bytes,
                                    limits.render_timeout_s)
    except TemplateRenderError as e:
        raise OpenAIError(str(e), 400, param="chat_template" if chat_template is not None else "messages") from e
    if not text:
        raise OpenAIError("the chat template rendered an empty prompt", 400, param="messages")
    return text


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
    if message.tool_calls is not None:
        result["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        result["reasoning_content"] = message.reasoning_content
    return result


def _template_tool_call(call: MessageToolCall) -> dict[str, Any]:
    """A call as chat templates read it: arguments decoded to an object (Hugging Face's
    convention, which templates' `arguments | tojson` expects), kept as text if not JSON."""
    arguments: Any = call.function.arguments
    try:
        decoded = json.loads(arguments)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict):
        arguments = decoded
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


class _ChoiceOutputs:
    """Each choice's own assembler (reasoning and tool-call parsing state), made on first use."""

    def __init__(self, plan: ToolPlan, tool_parser: Any, reasoning_parser: Any, include_reasoning: bool) -> None:
        self._plan = plan
        self._tool_parser = tool_parser
        self._reasoning_parser = reasoning_parser
        self._include_reasoning = include_reasoning
        self._assemblers: dict[int, ChoiceAssembler] = {}

    def assembler(self, index: int) -> ChoiceAssembler:
        if index not in self._assemblers:
            self._assemblers[index] = ChoiceAssembler(self._reasoning_parser, self._plan.stream(self._tool_parser),
                                                      self._include_reasoning)
        return self._assemblers[index]


class ChatServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        state = self.state
        model = state.check_model(request.model)
        self._check_supported(request)
        check_chat_request(state, request.messages, request.chat_template, request.chat_template_kwargs)
        plan = plan_tools(request, state.parsers.auto_tool_choice, state.limits)
        prompt_text, prompt_ids = await render_chat_prompt(
            state, request.messages, request.add_generation_prompt, request.chat_template,
            request.chat_template_kwargs, plan.tools)
        try:
            prompt_ids = state.engine.process_prompt({"prompt_token_ids": prompt_ids}, True,
                                                     request.truncate_prompt_tokens).prompt_token_ids
        except ValueError as e:
            raise from_value_error(e, param="messages") from e
        requested = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        max_tokens = resolve_max_tokens(requested, len(prompt_ids), state.max_model_len, "messages")
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        reasoning = self.reasoning_parser_for(prompt_text)
        structured, source = self.constraint_for(request, plan, reasoning is not None)
        params = build_sampling_params(request, max_tokens, top_logprobs, structured)
        if params.skip_special_tokens and self.needs_special_tokens(plan, reasoning is not None):
            params = params.clone(skip_special_tokens=False)
        await check_constraint_off_loop(state.engine, params, source)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = merge_streams([state.engine.generate({"prompt_token_ids": prompt_ids}, params, response_id,
                                                      request.priority,
                                                      lora_request=state.lora_request(request.model))])
        charge_tokens(raw_request, len(prompt_ids))  # the key's quota, if any: now, not when it ends
        stream = charged_outputs(raw_request, stream)
        outputs = _ChoiceOutputs(plan, state.parsers.tool_parser, reasoning, request.include_reasoning)
        try:
            if request.stream:
                try:
                    # Until the first output, a client that leaves is noticed here (then by Starlette).
                    _, rest = await until_disconnected(raw_request, first_and_rest(stream))
                except ClientDisconnected:
                    return Response(status_code=499)
                return StreamingResponse(self._stream(rest, request, response_id, model, len(prompt_ids), outputs),
                                         media_type="text/event-stream")
            try:
                body = await until_disconnected(raw_request, self._collect(stream, request, response_id, model,
                                                                           len(prompt_ids), outputs))
            except ClientDisconnected:
                return Response(status_code=499)
        except ValueError as e:
            raise constraint_error(e, source) from e
        return JSONResponse(body)

    def reasoning_parser_for(self, prompt_text: str) -> Any | None:
        """The server's reasoning parser, unless the prompt already closed the reasoning section
        (e.g. Qwen3 with thinking off): then the whole output is the answer."""
        parser = self.state.parsers.reasoning_parser
        return None if parser is None or parser.closed_by_prompt(prompt_text) else parser

    def constraint_for(self, request: ChatCompletionRequest, plan: ToolPlan,
                    reasoning: bool) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint (from the request's fields or its tool_choice) and where it came
        from; with a reasoning parser it applies only after the reasoning section ends."""
        structured, source = structured_outputs_of(request)
        schema = plan.constraint()
        if schema is not None:
            if source is not None:
                choice = "a named" if plan.mode == "named" else '"required"'
                raise OpenAIError(f"{source} cannot be combined with {choice} tool_choice, which already "
                                  f"constrains the output to the tool calls", 400, param=source)
            structured, source = make_structured_outputs({"json": json.dumps(schema)}, "tools"), "tools"
        if structured is not None and reasoning:
            structured = dataclasses.replace(
                structured, reasoning_end_token_ids=self.state.parsers.reasoning_end_token_ids)
        return structured, source

    def needs_special_tokens(self, plan: ToolPlan, reasoning: bool) -> bool:
        """Keep special tokens in the text when the parser's markers are special tokens."""
        parsers = self.state.parsers
        return (plan.mode == "auto" and parsers.tool_parser_name in SPECIAL_MARKER_TOOL_PARSERS) or \
            (reasoning and parsers.reasoning_tags_special)

    @staticmethod
    def _check_supported(request: ChatCompletionRequest) -> None:
        request.check_stream_options()
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", 400, param="top_logprobs")

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
                       response_id: str, model: str, num_prompt_tokens: int,
                       outputs: _ChoiceOutputs) -> dict[str, Any]:
        choices: dict[int, _Choice] = {}
        cached_tokens = 0
        kv_transfer_params = None
        prompt_logprobs = None
        async for _, output in stream:
            cached_tokens = output.num_cached_tokens
            prompt_logprobs = output.prompt_logprobs
            kv_transfer_params = output.kv_transfer_params or kv_transfer_params
            for completion in output.outputs:
                choice = choices.setdefault(completion.index, _Choice())
                choice.text.append(completion.text)
                choice.num_tokens += len(completion.token_ids)
                if request.logprobs:
                    choice.logprobs = (choice.logprobs or []) + self._logprobs(completion, request.top_logprobs or 0)
                if completion.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        response_choices = []
        for i, c in sorted(choices.items()):
            assembler = outputs.assembler(i)
            message = ChatResponseMessage(**assemble_message(assembler, "".join(c.text)))
            response_choices.append(ChatCompletionChoice(
                index=i, message=message,
                logprobs=ChatChoiceLogprobs(content=c.logprobs) if request.logprobs else None,
                finish_reason=assembler.finish_reason(c.finish_reason), stop_reason=c.stop_reason))
        response = ChatCompletionResponse(
            id=response_id, created=int(time.time()), model=model, choices=response_choices,
            usage=UsageInfo.of(num_prompt_tokens, sum(c.num_tokens for c in choices.values()), cached_tokens),
            kv_transfer_params=kv_transfer_params, prompt_logprobs=prompt_logprobs_body(prompt_logprobs))
        return response_body(response)

    # ---- streamed --------------------------------------------------------------------------
    async def _stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]], request: ChatCompletionRequest,
                      response_id: str, model: str, num_prompt_tokens: int,
                      choice_outputs: _ChoiceOutputs) -> AsyncIterator[str]:
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
                    assembler = choice_outputs.assembler(completion.index)
                    delta = assembler.feed(completion.text)
                    if completion.finish_reason is not None:
                        delta.add(assembler.finish())
                    elif not delta.wire() and completion.text and logprobs is None:
                        continue  # text a parser holds back (a possible tag): nothing to send yet
                    choices.append({"index": completion.index, "delta": delta.wire(), "logprobs": logprobs,
                                    "finish_reason": assembler.finish_reason(completion.finish_reason),
                                    "stop_reason": completion.stop_reason})
                if choices:
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
