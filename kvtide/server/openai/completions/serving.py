"""/v1/completions: prompts -> engine requests -> one JSON response or an SSE stream.

Each prompt of the request is one engine request (n samples each); choice index is
prompt_index * n + sample index, as OpenAI numbers them. With use_beam_search (non-streamed only)
the n samples are the n best beams, best first, exactly as offline `LLM.beam_search` returns them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtide.engine.input_processor import ProcessedPrompt
from kvtide.outputs import CompletionOutput, RequestOutput
from kvtide.sampling_params import SamplingParams
from kvtide.server.errors import OpenAIError, from_engine_error, from_value_error
from kvtide.server.openai import offload
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
from kvtide.server.openai.completions.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvtide.server.openai.offload import check_prompt_chars
from kvtide.server.openai.structured import check_constraint_off_loop, constraint_error, structured_outputs_of
from kvtide.server.quotas import charge_tokens, charged_outputs
from kvtide.server.state import ServerState


@dataclass
class _EchoedPrompt:
    text: str
    token_ids: list[int]


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        state = self.state
        model = state.check_model(request.model)
        self._check_supported(request)
        prompts = _normalize_prompts(request.prompt)
        limit = state.limits.max_prompts_per_request
        if len(prompts) * request.n > limit:
            raise OpenAIError(f"prompt: at most {limit} completions per request (prompts x n), got "
                              f"{len(prompts)} x {request.n}", 400, param="prompt")
        structured, source = structured_outputs_of(request)
        processed = await offload.tokenize(self._process_prompts, prompts, request.add_special_tokens,
                                           request.truncate_prompt_tokens,
                                           timeout_s=state.limits.render_timeout_s, param="prompt")
        prompt_ids = [p.prompt_token_ids for p in processed]
        params = [build_sampling_params(
            request, resolve_max_tokens(request.max_tokens, len(ids), state.max_model_len, "prompt"),
            request.logprobs, structured) for ids in prompt_ids]
        echo = None
        if request.echo:
            echo = [_EchoedPrompt(self._prompt_text(p), p.prompt_token_ids) for p in processed]
            if request.logprobs is not None:  # the prompt's own logprobs lead the choice's
                k = max(request.logprobs, request.prompt_logprobs or 0)
                params = [p.clone(prompt_logprobs=k) for p in params]
        if request.use_beam_search:
            params = [_beam_search_params(request, p) for p in params]
        if params:
            await check_constraint_off_loop(state.engine, params[0], source)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        lora_request = state.lora_request(request.model)
        streams = [state.engine.generate(prompt, p, f"{response_id}-{i}", request.priority, lora_request=lora_request)
                   for i, (prompt, p) in enumerate(zip(processed, params, strict=False))]
        num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
        charge_tokens(raw_request, num_prompt_tokens)  # the key's quota, if any: now, not when it ends
        merged = charged_outputs(raw_request, merge_streams(streams))
        try:
            if request.stream:
                try:
                    # Until the first output, a client that leaves is noticed here (then by Starlette).
                    _, rest = await until_disconnected(raw_request, first_and_rest(merged))
                except ClientDisconnected:
                    return Response(status_code=499)
                return StreamingResponse(self._stream(rest, request, response_id, model, num_prompt_tokens, echo),
                                         media_type="text/event-stream")
            try:
                body = await until_disconnected(
                    raw_request, self._collect(merged, request, response_id, model, num_prompt_tokens, echo))
            except ClientDisconnected:
                return Response(status_code=499)
        except ValueError as e:
            raise constraint_error(e, source) from e
        return JSONResponse(body)

    def _process_prompts(self, prompts: list[Any], add_special_tokens: bool,
                         truncate_prompt_tokens: int | None) -> list[ProcessedPrompt]:
        """Tokenize and validate every prompt (on the tokenizer's thread: a text longer than
        max_model_len tokens can hold is refused without tokenizing it), each cut to its last
        truncate_prompt_tokens tokens if set."""
        state = self.state
        processed = []
        for prompt in prompts:
            if isinstance(prompt, str):
                check_prompt_chars(state.tokenizer, prompt, state.max_model_len, "prompt")
            try:
                processed.append(state.engine.process_prompt(prompt, add_special_tokens, truncate_prompt_tokens))
            except ValueError as e:
                raise from_value_error(e, param="prompt") from e
        return processed

    def _prompt_text(self, prompt: ProcessedPrompt) -> str:
        """What echo repeats: the prompt's text, or its tokens decoded for a token-id prompt."""
        if prompt.prompt is not None:
            return prompt.prompt
        return self.state.tokenizer.decode(prompt.prompt_token_ids)

    @staticmethod
    def _check_supported(request: CompletionRequest) -> None:
        request.check_stream_options()
        if request.echo and request.stream and request.logprobs is not None:
            raise OpenAIError("echo with logprobs is not available with stream=true (the prompt's logprobs "
                              "come with the whole response); send stream=false", 400, param="echo")
        if request.suffix:
            raise OpenAIError("suffix is not supported", 400, param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of other than n is not supported", 400, param="best_of")
        if request.use_beam_search and request.stream:
            raise OpenAIError("use_beam_search does not support stream=true: the beams are known only when "
                              "the search ends; send stream=false", 400, param="stream")

    # ---- non-streamed ----------------------------------------------------------------------
    async def _collect(self, merged: AsyncIterator[tuple[int, RequestOutput]], request: CompletionRequest,
                       response_id: str, model: str, num_prompt_tokens: int,
                       echo: list[_EchoedPrompt] | None) -> dict[str, Any]:
        choices: dict[int, _Choice] = {}
        cached_tokens: dict[int, int] = {}
        prompt_logprobs: dict[int, Any] = {}
        kv_transfer_params = None
        async for prompt_index, output in merged:
            cached_tokens[prompt_index] = output.num_cached_tokens
            prompt_logprobs[prompt_index] = output.prompt_logprobs
            kv_transfer_params = output.kv_transfer_params or kv_transfer_params
            for completion in output.outputs:
                index = prompt_index * request.n + completion.index
                if index not in choices:
                    choices[index] = self._echoed_choice(echo[prompt_index], output, request.logprobs) \
                        if echo is not None else _Choice()
                choice = choices[index]
                choice.text.append(completion.text)
                choice.num_tokens += len(completion.token_ids)
                if request.logprobs is not None:
                    choice.logprobs = self._logprobs(completion, request.logprobs, choice.logprobs,
                                                     sum(len(t) for t in choice.text[:-1]))
                if completion.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        response = CompletionResponse(
            id=response_id, created=int(time.time()), model=model,
            choices=[CompletionChoice(index=i, text="".join(c.text), logprobs=c.logprobs,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      prompt_logprobs=prompt_logprobs_body(prompt_logprobs.get(i // request.n))
                                      if request.prompt_logprobs is not None else None)
                     for i, c in sorted(choices.items())],
            usage=UsageInfo.of(num_prompt_tokens, sum(c.num_tokens for c in choices.values()),
                               sum(cached_tokens.values())), kv_transfer_params=kv_transfer_params)
        return response_body(response)

    def _echoed_choice(self, echoed: _EchoedPrompt, output: RequestOutput, k: int | None) -> _Choice:
        """A choice starting with its prompt (echo): the prompt's text and, with logprobs, one
        entry per prompt token (the first has no logprob: nothing predicts it), as OpenAI's
        legacy completions answer."""
        choice = _Choice(text=[echoed.text])
        if k is None:
            return choice
        token_text = self.state.token_text
        logprobs = CompletionLogprobs()
        offset = 0
        entries = output.prompt_logprobs or [None] * len(echoed.token_ids)
        for token_id, entry in zip(echoed.token_ids, entries, strict=False):
            text = token_text(token_id)
            logprobs.tokens.append(text)
            logprobs.token_logprobs.append(None if entry is None else safe_float(chosen_logprob(entry, token_id)))
            logprobs.top_logprobs.append(_top_dict(token_text, entry, k) if entry is not None and k > 0 else None)
            logprobs.text_offset.append(offset)
            offset += len(text)
        choice.logprobs = logprobs
        return choice

    def _logprobs(self, completion: CompletionOutput, k: int, into: CompletionLogprobs | None,
                  text_offset: int) -> CompletionLogprobs:
        result = into or CompletionLogprobs()
        offset = result.text_offset[-1] + len(result.tokens[-1]) if result.tokens else text_offset
        token_text = self.state.token_text
        for token_id, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
            text = token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(safe_float(chosen_logprob(entry, token_id)))
            result.top_logprobs.append(_top_dict(token_text, entry, k) if k > 0 else None)
            result.text_offset.append(offset)
            offset += len(text)
        return result

    # ---- streamed --------------------------------------------------------------------------
    async def _stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]], request: CompletionRequest,
                      response_id: str, model: str, num_prompt_tokens: int,
                      echo: list[_EchoedPrompt] | None) -> AsyncIterator[str]:
        created = int(time.time())
        echoed: set[int] = set()
        include_usage = request.include_usage_in_stream()
        num_completion_tokens = 0
        cached_tokens: dict[int, int] = {}
        logprobs_state: dict[int, CompletionLogprobs] = {}
        try:
            async for prompt_index, output in outputs:
                cached_tokens[prompt_index] = output.num_cached_tokens
                choices = []
                for completion in output.outputs:
                    index = prompt_index * request.n + completion.index
                    num_completion_tokens += len(completion.token_ids)
                    logprobs = None
                    if request.logprobs is not None:
                        previous = logprobs_state.get(index)
                        base = previous.text_offset[-1] + len(previous.tokens[-1]) \
                            if previous and previous.tokens else 0
                        delta = self._logprobs(completion, request.logprobs, None, base)
                        if delta.tokens:
                            logprobs_state[index] = delta
                        logprobs = delta.model_dump()
                    text = completion.text
                    if echo is not None and index not in echoed:  # the prompt leads the choice's first chunk
                        echoed.add(index)
                        text = echo[prompt_index].text + text
                    choices.append({"index": index, "text": text, "logprobs": logprobs,
                                    "finish_reason": completion.finish_reason,
                                    "stop_reason": completion.stop_reason})
                chunk: dict[str, Any] = {"id": response_id, "object": "text_completion", "created": created,
                                         "model": model, "choices": choices}
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
            if include_usage:
                yield sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": UsageInfo.of(num_prompt_tokens, num_completion_tokens,
                                                                sum(cached_tokens.values())).model_dump()})
        except Exception as e:
            yield sse(from_engine_error(e).body())
        finally:
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()
        yield SSE_DONE


_NEUTRAL_SAMPLING = (("temperature", 0.0), ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0))
"""Sampling knobs beam search ignores, with the one value each may take along with it."""


def _beam_search_params(request: CompletionRequest, params: SamplingParams) -> SamplingParams:
    """vLLM's convention: n is the beam width and all n beams come back; kvtide's beam_width may
    widen the search (the n best of beam_width beams come back). The search is deterministic, as
    HF's is: a sampling knob set to anything that would change it is refused, not ignored."""
    for name, neutral in _NEUTRAL_SAMPLING:
        value = getattr(request, name)
        if value is not None and value != neutral:
            raise OpenAIError(f"{name}={value!r} does not apply to use_beam_search (a deterministic search); "
                              f"omit it or send {neutral!r}", 400, param=name)
    if request.beam_width is not None and request.beam_width < request.n:
        raise OpenAIError(f"beam_width ({request.beam_width}) must be >= n ({request.n}): the n best of "
                          f"beam_width beams are returned", 400, param="beam_width")
    try:
        return params.clone(use_beam_search=True, beam_width=request.beam_width, temperature=0.0,
                            length_penalty=request.length_penalty, early_stopping=request.early_stopping)
    except ValueError as e:
        raise from_engine_error(e) from e


def _top_dict(token_text, entry, k: int) -> dict[str, float]:
    """{token text: logprob} of the top k; distinct ids with the same text (byte pieces that decode
    to U+FFFD) keep the likelier one."""
    top: dict[str, float] = {}
    for token_id, logprob in top_entries(entry, k):
        top.setdefault(token_text(token_id), safe_float(logprob.logprob))
    return top


def _normalize_prompts(prompt: Any) -> list[Any]:
    """str | list[str] | list[int] | list[list[int]] -> a list of prompts (str or token-id lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", 400, param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)
