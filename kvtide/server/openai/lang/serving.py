"""/v1/lang/score: the log-likelihood of each choice continuing a prompt, over the prefix cache.

    1. tokenize the prompt and each prompt + choice; a choice's tokens are those after the ones it
       shares with the prompt's own tokens (a merge across the boundary belongs to the choice);
    2. run the prompt alone for one token, so its full blocks are in the prefix cache;
    3. run every prompt + choice at once for one token with prompt_logprobs from the choice's first
       token on (prompt_logprobs_start): the cache serves the shared prefix, and each request
       computes only the prompt's last partial block and its choice.
"""

from __future__ import annotations

import math
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvtide.engine.input_processor import ProcessedPrompt
from kvtide.engine.output_processor import RequestOutputKind
from kvtide.outputs import RequestOutput
from kvtide.sampling_params import SamplingParams
from kvtide.server.errors import OpenAIError, from_value_error
from kvtide.server.openai import offload
from kvtide.server.openai.common import ClientDisconnected, merge_streams, until_disconnected
from kvtide.server.openai.lang.protocol import ScoredChoice, ScoreRequest, ScoreResponse
from kvtide.server.openai.offload import check_prompt_chars
from kvtide.server.quotas import charge_tokens
from kvtide.server.state import ServerState


async def score_choices(state: ServerState, request: ScoreRequest, raw_request: Request) -> Response:
    model = state.check_model(request.model)
    prefix, fulls = await offload.tokenize(_tokenize, state, request, timeout_s=state.limits.render_timeout_s,
                                           param="prompt")
    starts = [_choice_start(prefix.prompt_token_ids, full.prompt_token_ids, i) for i, full in enumerate(fulls)]
    charge_tokens(raw_request, len(prefix.prompt_token_ids) + sum(len(f.prompt_token_ids) for f in fulls))
    try:
        outputs = await until_disconnected(raw_request, _run(state, request, prefix, fulls, starts))
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for i, (full, start, output) in enumerate(zip(fulls, starts, outputs, strict=True)):
        ids = full.prompt_token_ids
        entries = output.prompt_logprobs or []
        logprobs = [entries[j][ids[j]].logprob for j in range(start, len(ids))]  # type: ignore[index]
        choices.append(ScoredChoice(index=i, text=request.choices[i], token_ids=list(ids[start:]),
                                    token_logprobs=logprobs, normalized_logprob=math.fsum(logprobs) / len(logprobs),
                                    prompt_tokens=len(ids), cached_tokens=output.num_cached_tokens))
    body = ScoreResponse(model=model, prompt_tokens=len(prefix.prompt_token_ids), choices=choices)
    return JSONResponse(body.model_dump())


def _tokenize(state: ServerState, request: ScoreRequest) -> tuple[ProcessedPrompt, list[ProcessedPrompt]]:
    prompt = request.prompt
    try:
        if isinstance(prompt, str):
            check_prompt_chars(state.tokenizer, prompt, state.max_model_len, "prompt")
            prefix = state.engine.process_prompt(prompt, request.add_special_tokens)
            fulls = [state.engine.process_prompt(prompt + c, request.add_special_tokens) for c in request.choices]
        else:
            prefix = state.engine.process_prompt(list(prompt), False)
            fulls = [state.engine.process_prompt(list(prompt) + state.tokenizer.encode(c, add_special_tokens=False),
                                                 False) for c in request.choices]
    except ValueError as e:
        raise from_value_error(e, param="prompt") from e
    for full in fulls:  # room for the one token each request generates
        if len(full.prompt_token_ids) >= state.max_model_len:
            raise OpenAIError(f"prompt and choice take {len(full.prompt_token_ids)} tokens, which leaves no room "
                              f"in this model's maximum context length of {state.max_model_len} tokens", 400,
                              param="choices", code="context_length_exceeded")
    return prefix, fulls


def _choice_start(prefix_ids: list[int], full_ids: list[int], index: int) -> int:
    start = 0
    while start < min(len(prefix_ids), len(full_ids)) and prefix_ids[start] == full_ids[start]:
        start += 1
    if start == 0:
        raise OpenAIError("the prompt and a choice share no first token, so the choice's first token has no "
                          "logprob", 400, param="prompt")
    if start == len(full_ids):
        raise OpenAIError(f"choices[{index}] adds no tokens to the prompt", 400, param="choices")
    return start


async def _run(state: ServerState, request: ScoreRequest, prefix: ProcessedPrompt, fulls: list[ProcessedPrompt],
               starts: list[int]) -> list[RequestOutput]:
    request_id = f"score-{uuid.uuid4().hex}"
    common = {"max_tokens": 1, "temperature": 0.0, "cache_salt": request.cache_salt}
    async for _ in state.engine.generate(prefix, SamplingParams(**common), f"{request_id}-prefix", request.priority,
                                         output_kind=RequestOutputKind.FINAL_ONLY):
        pass
    streams = [state.engine.generate(full, SamplingParams(**common, prompt_logprobs=0, prompt_logprobs_start=start),
                                     f"{request_id}-{i}", request.priority, output_kind=RequestOutputKind.FINAL_ONLY)
               for i, (full, start) in enumerate(zip(fulls, starts, strict=True))]
    outputs: dict[int, RequestOutput] = {}
    async for index, output in merge_streams(streams):
        outputs[index] = output
    return [outputs[i] for i in range(len(fulls))]
