"""What the OpenAI endpoints share: the sampling fields of the protocol, their translation into
SamplingParams, the max_tokens rule, logprob text, SSE framing, stream merging and disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvtide.outputs import Logprob, PromptLogprobs
from kvtide.sampling_params import (
    GENERATION_DEFAULT_FIELDS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)
from kvtide.server.errors import OpenAIError, from_engine_error
from kvtide.server.limits import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

__all__ = ["MAX_N"]  # re-exported: it used to live here

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
NonNegInt = Annotated[int, Field(ge=0, le=2**31 - 1)]


class OpenAIBaseModel(BaseModel):
    """Strict types ("5" is not an integer, true is not 1); unknown fields are ignored, as OpenAI's
    clients send extras freely."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        """JSON may escape lone surrogates ("\\ud800"), which no tokenizer can encode: a 400 here,
        not a TypeError (500) deep in the tokenizer."""
        _check_unicode(value, info.field_name or "body")
        return value


def _check_unicode(value: Any, field: str | None) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{field} holds a lone UTF-16 surrogate (\\u{ord(e.object[e.start]):04x}), which is "
                             f"not valid Unicode") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_unicode(item, field)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, field)
            _check_unicode(item, field)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (RequestOutput.num_cached_tokens)."""


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class SamplingRequest(OpenAIBaseModel):
    """Fields /v1/completions and /v1/chat/completions share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1e6)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    """Prefix-cache tenant key: requests with different salts never share cached KV."""
    speculation: bool = True
    """On a server with a speculative config, false decodes this request without draft tokens."""
    kv_transfer_params: dict[str, Any] | None = None
    """For a KV connector: {"do_remote_decode": true} on a prefill instance; the params its response
    returned, on a decode instance (kvtide/disagg/p2p.py)."""
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    """vLLM's extra: the logprob of every prompt token (and this many alternatives), non-streamed
    only; the prompt is then computed in full, without the prefix cache."""
    bad_words: list[str] | None = None
    """vLLM's extra: words never generated (with or without a leading space)."""
    allowed_token_ids: list[NonNegInt] | None = None
    """vLLM's extra: only these token ids may be generated."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    """vLLM's extra: keep the prompt's last k tokens (-1: as many as the context leaves room for)."""
    vllm_xargs: dict[str, Any] | None = None
    """vLLM's extra: per-request arguments for the server's logits processors (SamplingParams.extra_args)."""

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed when stream is true", 400, param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise OpenAIError("prompt_logprobs is not available with stream=true (as in vLLM)", 400,
                              param="prompt_logprobs")

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def response_body(response: BaseModel) -> dict[str, Any]:
    """A non-streamed response as JSON, without kv_transfer_params unless a KV connector set them
    and without prompt_logprobs unless the request asked for them."""
    body = response.model_dump()
    for holder in (body, *body.get("choices", ())):
        for name in ("kv_transfer_params", "prompt_logprobs"):
            if name in holder and holder[name] is None:
                del holder[name]
    return body


def prompt_logprobs_body(entries: PromptLogprobs | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's JSON of prompt logprobs: per prompt position (the first has none), token id ->
    {logprob, rank, decoded_token} for the prompt's token and the top alternatives."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(token_id): {"logprob": safe_float(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()}
            for entry in entries]


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       prompt_param: str) -> int:
    """max_tokens, defaulting to what fits in max_model_len; 400 context_length_exceeded if the
    prompt plus the requested tokens do not fit."""
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise OpenAIError(f"This model's maximum context length is {max_model_len} tokens, but the prompt "
                          f"has {num_prompt_tokens} tokens, which leaves no room to generate.", 400,
                          param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return room
    if requested > room:
        raise OpenAIError(f"This model's maximum context length is {max_model_len} tokens. However, you "
                          f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                          f"prompt, {requested} for the completion). Please reduce the prompt or max_tokens.",
                          400, param="max_tokens", code="context_length_exceeded")
    return requested


def build_sampling_params(request: SamplingRequest, max_tokens: int, logprobs: int | None,
                          structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    _check_list_limits(request)
    logit_bias = None
    if request.logit_bias is not None:
        try:
            logit_bias = {int(k): v for k, v in request.logit_bias.items()}
        except ValueError as e:
            raise OpenAIError("logit_bias keys must be token ids (integers as strings)", 400,
                              param="logit_bias") from e
    if request.min_tokens > max_tokens:
        raise OpenAIError(f"min_tokens ({request.min_tokens}) must be <= max_tokens ({max_tokens})", 400,
                          param="min_tokens")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise OpenAIError(f"logprobs must be in [0, {MAX_LOGPROBS}]", 400, param="logprobs")

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    # Left out when the request omits them: the model's generation_config.json may set them.
    model_defaulted = {name: getattr(request, name) for name in GENERATION_DEFAULT_FIELDS
                       if getattr(request, name) is not None}
    try:
        return SamplingParams(
            n=request.n, presence_penalty=pick(request.presence_penalty, 0.0),
            frequency_penalty=pick(request.frequency_penalty, 0.0), **model_defaulted, seed=request.seed, stop=request.stop, stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos, max_tokens=max_tokens, min_tokens=request.min_tokens,
            logprobs=logprobs, skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output, logit_bias=logit_bias,
            cache_salt=request.cache_salt, speculation=request.speculation, prompt_logprobs=request.prompt_logprobs,
            structured_outputs=structured_outputs, kv_transfer_params=request.kv_transfer_params,
            bad_words=request.bad_words, allowed_token_ids=request.allowed_token_ids,
            truncate_prompt_tokens=request.truncate_prompt_tokens, extra_args=request.vllm_xargs)
    except ValueError as e:
        raise from_engine_error(e) from e


def _check_list_limits(request: SamplingRequest) -> None:
    """The size limits of kvtide/server/limits.py on stop, stop_token_ids and logit_bias."""
    stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise OpenAIError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", 400, param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise OpenAIError(f"stop: a stop string may have at most {MAX_STOP_STRING_CHARS} characters", 400,
                          param="stop")
    if request.stop_token_ids is not None and len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise OpenAIError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} entries, got "
                          f"{len(request.stop_token_ids)}", 400, param="stop_token_ids")
    if request.bad_words is not None and (len(request.bad_words) > MAX_BAD_WORDS or any(
            len(w) > MAX_STOP_STRING_CHARS for w in request.bad_words)):
        raise OpenAIError(f"bad_words: at most {MAX_BAD_WORDS} words of at most {MAX_STOP_STRING_CHARS} "
                          "characters each", 400, param="bad_words")
    if request.logit_bias is not None and len(request.logit_bias) > MAX_LOGIT_BIAS:
        raise OpenAIError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(request.logit_bias)}", 400,
                          param="logit_bias")


# ---- logprobs ------------------------------------------------------------------------------------
def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens at one position, most likely first."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    return [(tid, lp) for tid, lp in ranked if lp.rank is not None and lp.rank <= k][:k]


def chosen_logprob(entry: dict[int, Logprob], token_id: int) -> float:
    logprob = entry.get(token_id)
    return logprob.logprob if logprob is not None else float("-inf")


def safe_float(value: float) -> float:
    """JSON has no -inf or NaN: report them as -9999.0 (a probability of zero, for any client)."""
    if value != value:
        return -9999.0
    return max(value, -9999.0)


# ---- streaming -----------------------------------------------------------------------------------
_LINE_BREAKS_IN_JSON = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})
"""Characters json.dumps leaves raw that str.splitlines() (and so many SSE clients, httpx's
aiter_lines among them) treat as line ends: escaped, an event stays one line."""


def sse(payload: dict[str, Any]) -> str:
    data = json.dumps(payload, ensure_ascii=False, allow_nan=False).translate(_LINE_BREAKS_IN_JSON)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"

T = TypeVar("T")


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as their items arrive: (stream index, item). An error in
    any stream is raised; leaving early (or an error) closes them all, which aborts their requests."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await _aclose(streams[0])
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
        except Exception as e:
            await queue.put((index, None, e))
        finally:
            await _aclose(stream)
            await queue.put((index, done, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def first_and_rest(stream: AsyncIterator[T]) -> tuple[T | None, AsyncIterator[T]]:
    """Wait for the first item (so admission errors become HTTP errors before any header is sent),
    then give back an iterator over everything including it. On an error the stream is closed."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return None, _empty()
    except BaseException:
        await _aclose(stream)
        raise

    async def chained() -> AsyncIterator[T]:
        try:
            yield first
            async for item in stream:
                yield item
        finally:
            await _aclose(stream)

    return first, chained()


async def _empty() -> AsyncIterator[Any]:
    return
    yield  # pragma: no cover


class ClientDisconnected(Exception):
    pass


async def until_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client goes away first, cancel it (which aborts its requests in the
    engine) and raise ClientDisconnected. Starlette does this itself only for streamed bodies."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        watch_task.cancel()
        raise
    if work_task in done:
        watch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch_task
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work_task
    raise ClientDisconnected


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return
