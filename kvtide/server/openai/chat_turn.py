"""One assistant turn of a chat-shaped request, for the APIs that are chat underneath
(/v1/responses, Anthropic's /v1/messages).

Each translates its body into a ChatCompletionRequest (n = 1); this module renders, constrains
and runs it exactly as /v1/chat/completions does (the same template, tool plan, structured
output and reasoning parser), and hands the answer back as ChoiceDeltas (reasoning, content,
tool-call deltas), which each API shapes into its own output. A stream and a whole response read
the same deltas, so the stream always concatenates to the whole one.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from kvtide.outputs import RequestOutput
from kvtide.server.errors import OpenAIError, from_value_error
from kvtide.server.openai.chat_completions.assembly import ChoiceAssembler, ChoiceDelta
from kvtide.server.openai.chat_completions.protocol import ChatCompletionRequest
from kvtide.server.openai.chat_completions.serving import ChatServing, render_chat_prompt
from kvtide.server.openai.chat_completions.tools import plan_tools
from kvtide.server.openai.common import (
    build_sampling_params,
    first_and_rest,
    merge_streams,
    resolve_max_tokens,
    until_disconnected,
)
from kvtide.server.openai.structured import check_constraint_off_loop, constraint_error
from kvtide.server.quotas import charge_tokens, charged_outputs
from kvtide.server.state import ServerState


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A ChatCompletionRequest of already-checked parts; a part the chat protocol still refuses is
    a 400, not a 500."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise OpenAIError(f"{where}: {first.get('msg', 'invalid value')}", 400, param=where.split(".")[0] or None) \
            from e


class ChatTurn:
    """A running turn: iterate `deltas()` once; the counts and finish reason are final after it."""

    def __init__(self, outputs: AsyncIterator[tuple[int, RequestOutput]], assembler: ChoiceAssembler,
                 num_prompt_tokens: int, source: str | None) -> None:
        self._outputs = outputs
        self._assembler = assembler
        self._source = source
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.engine_finish_reason: str | None = None
        """The engine's: "stop", "length" or "abort" (None while running)."""
        self.stop_reason: int | str | None = None
        """The stop string or token id that ended the answer, if one did."""

    @property
    def finish_reason(self) -> str | None:
        """As chat reports it: "tool_calls" for an answer that ended in calls."""
        return self._assembler.finish_reason(self.engine_finish_reason)

    @property
    def num_tool_calls(self) -> int:
        return self._assembler.num_tool_calls

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The answer as it is generated (the last delta includes what the parsers held back)."""
        finished = False
        try:
            async for _, output in self._outputs:
                self.num_cached_tokens = output.num_cached_tokens
                for completion in output.outputs:
                    self.num_output_tokens += len(completion.token_ids)
                    delta = self._assembler.feed(completion.text)
                    if completion.finish_reason is not None:
                        delta.add(self._assembler.finish())
                        self.engine_finish_reason = completion.finish_reason
                        self.stop_reason = completion.stop_reason
                        finished = True
                    yield delta
            if not finished:
                yield self._assembler.finish()
        except ValueError as e:
            raise constraint_error(e, self._source) from e
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Stop the turn (aborting its request in the engine if it still runs)."""
        aclose = getattr(self._outputs, "aclose", None)
        if aclose is not None:
            await aclose()


async def start_turn(state: ServerState, request: ChatCompletionRequest, raw_request: Request,
                     request_id: str | None = None) -> ChatTurn:
    """Render, plan and submit `request`, and wait for its first output, so that a refusal (a bad
    tool, a prompt too long, a full queue, a bad schema) is raised here, before any answer is sent.
    Raises ClientDisconnected if the client leaves meanwhile."""
    serving = ChatServing(state)
    plan = plan_tools(request, state.parsers.auto_tool_choice, state.limits)
    prompt_text, prompt_ids = await render_chat_prompt(
        state, request.messages, request.add_generation_prompt, request.chat_template,
        request.chat_template_kwargs, plan.tools)
    try:
        prompt_ids = state.engine.process_prompt({"prompt_token_ids": prompt_ids}).prompt_token_ids
    except ValueError as e:
        raise from_value_error(e, param="messages") from e
    max_tokens = resolve_max_tokens(request.max_completion_tokens, len(prompt_ids), state.max_model_len, "messages")
    reasoning = serving.reasoning_parser_for(prompt_text)
    structured, source = serving.constraint_for(request, plan, reasoning is not None)
    params = build_sampling_params(request, max_tokens, None, structured)
    if params.skip_special_tokens and serving.needs_special_tokens(plan, reasoning is not None):
        params = params.clone(skip_special_tokens=False)
    await check_constraint_off_loop(state.engine, params, source)
    stream = merge_streams([state.engine.generate({"prompt_token_ids": prompt_ids}, params,
                                                  request_id or f"turn-{uuid.uuid4().hex}", request.priority)])
    charge_tokens(raw_request, len(prompt_ids))
    stream = charged_outputs(raw_request, stream)
    try:
        _, rest = await until_disconnected(raw_request, first_and_rest(stream))
    except ValueError as e:
        raise constraint_error(e, source) from e
    assembler = ChoiceAssembler(reasoning, plan.stream(state.parsers.tool_parser), request.include_reasoning)
    return ChatTurn(rest, assembler, len(prompt_ids), source)
