"""The pooling endpoints' work: inputs tokenized off the event loop and validated, one
prefill-only engine request per input (they batch in the engine like any others), results in
the endpoint's shape.

Scoring as vLLM's: a classification model is a cross-encoder (each pair tokenized together with the
tokenizer's pair template, scored by its head); an embedding model scores by the cosine of the two
texts' embeddings. Rerank is scoring of the query against every document, sorted best first.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any

from kvtide.engine.input_processor import ProcessedPrompt
from kvtide.engine.output_processor import RequestOutputKind
from kvtide.pooling.config import PoolerConfig
from kvtide.pooling.outputs import PoolingRequestOutput, cosine_similarity
from kvtide.pooling.params import PoolingParams
from kvtide.pooling.scoring import check_truncation, score_pairs, tokenize_text, truncate_ids
from kvtide.sampling_params import SamplingParams
from kvtide.server.errors import OpenAIError, from_value_error
from kvtide.server.openai import offload
from kvtide.server.openai.pooling.protocol import (
    MAX_POOLING_INPUTS,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from kvtide.server.state import ServerState

_API_NAMES = {"embed": "Embeddings API", "classify": "Classification API", "score": "Score API",
              "rerank": "Rerank API", "encode": "Pooling API"}


def pooler_of(state: ServerState, api: str, needs: str | None = None) -> PoolerConfig:
    """The served model's pooler; 400 when it cannot serve `api` (a generation model, or an
    embedding model asked to classify)."""
    fields = state.engine.info.pooler
    config = PoolerConfig.from_fields(fields) if fields is not None else None
    if config is None or (needs is not None and config.task != needs):
        raise OpenAIError(f"The model does not support {_API_NAMES[api]}", 400, code="model_not_supported")
    return config


async def embeddings(state: ServerState, request: EmbeddingRequest, api: str = "embed"
                     ) -> EmbeddingResponse | PoolingResponse:
    model = state.check_model(request.model)
    config = pooler_of(state, api, needs="embed" if api == "embed" else None)
    if api == "embed":
        try:
            config.check_dimensions(request.dimensions, state.engine.info.pooler["hidden_size"])
        except ValueError as e:
            raise OpenAIError(str(e), 400, param="dimensions") from None
    prompts = await _prepare(state, _inputs(request.input), request.truncate_prompt_tokens,
                             request.add_special_tokens)
    task = "embed" if config.task == "embed" else "encode"
    params = PoolingParams(task=task, normalize=request.normalize,
                           dimensions=request.dimensions if api == "embed" else None)
    outputs = await _run(state, prompts, params, "embd" if api == "embed" else "pool")
    usage = _usage(outputs)
    created = int(time.time())
    encode = _base64 if request.encoding_format == "base64" else list
    if api == "embed":
        return EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", created=created, model=model, usage=usage,
                                 data=[EmbeddingData(index=i, embedding=encode(o.outputs.data))
                                       for i, o in enumerate(outputs)])
    return PoolingResponse(id=f"pool-{uuid.uuid4().hex}", created=created, model=model, usage=usage,
                           data=[PoolingData(index=i, data=encode(o.outputs.data)) for i, o in enumerate(outputs)])


async def classify(state: ServerState, request: ClassificationRequest) -> ClassificationResponse:
    model = state.check_model(request.model)
    config = pooler_of(state, "classify", needs="classify")
    prompts = await _prepare(state, _inputs(request.input), request.truncate_prompt_tokens)
    outputs = await _run(state, prompts, PoolingParams(task="classify", use_activation=request.activation), "classify")
    data = []
    for i, output in enumerate(outputs):
        probs = output.outputs.data
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(index=i, label=config.id2label.get(best), probs=probs, num_classes=len(probs)))
    return ClassificationResponse(id=f"classify-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                  data=data, usage=_usage(outputs))


async def score(state: ServerState, request: ScoreRequest) -> ScoreResponse:
    model = state.check_model(request.model)
    pooler_of(state, "score")
    try:
        pairs = score_pairs(request.text_1, request.text_2)
    except ValueError as e:
        raise OpenAIError(str(e), 400, param="text_2") from None
    scores, usage = await _score_pairs(state, pairs, request.truncate_prompt_tokens)
    return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model, usage=usage,
                         data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)])


async def rerank(state: ServerState, request: RerankRequest) -> RerankResponse:
    model = state.check_model(request.model)
    pooler_of(state, "rerank")
    if not request.documents:
        raise OpenAIError("documents must not be empty", 400, param="documents")
    if not request.query:
        raise OpenAIError("query must not be empty", 400, param="query")
    scores, usage = await _score_pairs(state, [(request.query, d) for d in request.documents],
                                       request.truncate_prompt_tokens)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep document order
    if request.top_n:
        order = order[:request.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=request.documents[i]) if request.return_documents else None)
               for i in order]
    return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, results=results,
                          usage={"total_tokens": usage.total_tokens})


# ---- steps ---------------------------------------------------------------------------------------
def _inputs(value: Any) -> list[str | list[int]]:
    """The request's inputs as a list of texts or token id lists."""
    if isinstance(value, str):
        items: list = [value]
    elif value and all(isinstance(t, int) for t in value):
        items = [list(value)]
    else:
        items = list(value)
    if not items:
        raise OpenAIError("input must not be empty", 400, param="input")
    if len(items) > MAX_POOLING_INPUTS:
        raise OpenAIError(f"input: at most {MAX_POOLING_INPUTS} inputs per request, got {len(items)}", 400,
                          param="input")
    for item in items:
        if len(item) == 0:
            raise OpenAIError("input must not be empty (an empty string or token list)", 400, param="input")
    return items


async def _prepare(state: ServerState, items: list, truncate: int | None, add_special_tokens: bool = True,
                   pairs: bool = False) -> list[ProcessedPrompt]:
    """Tokenized, cut to `truncate_prompt_tokens` and validated, off the event loop (400 on the
    first bad input)."""
    tokenizer, processor = state.tokenizer, state.engine.input_processor
    try:
        keep = check_truncation(truncate, processor.max_prompt_len)
    except ValueError as e:
        raise OpenAIError(str(e), 400, param="truncate_prompt_tokens") from None
    limit = offload.prompt_chars_limit(tokenizer, state.max_model_len) if keep is None else None

    def prepare() -> list[ProcessedPrompt]:
        processed = []
        for item in items:
            if pairs or isinstance(item, str):
                first, second = item if pairs else (item, None)
                for text in (first, second):
                    if limit is not None and text is not None and len(text) > limit:
                        raise ValueError(f"prompt has {len(text)} characters, more than max_model_len="
                                         f"{state.max_model_len} tokens can hold; set truncate_prompt_tokens")
                if keep is None and second is None:
                    processed.append(processor.process_prompt(first, add_special_tokens))
                    continue
                ids = tokenize_text(tokenizer, first, second, keep)
                processed.append(ProcessedPrompt(None if second is not None else first,
                                                 processor.process_prompt(ids).prompt_token_ids))
            else:
                processed.append(processor.process_prompt(truncate_ids(item, keep)))
        return processed

    try:
        return await offload.tokenize(prepare, timeout_s=state.limits.render_timeout_s, param="input")
    except ValueError as e:
        raise from_value_error(e, param="input") from None


async def _run(state: ServerState, prompts: list[ProcessedPrompt], params: PoolingParams,
               prefix: str) -> list[PoolingRequestOutput]:
    """One engine request per prompt, all in flight at once; leaving early aborts the rest."""
    base = f"{prefix}-{uuid.uuid4().hex}"

    async def one(i: int, prompt: ProcessedPrompt) -> PoolingRequestOutput:
        result = None
        async for output in state.engine.generate(prompt, SamplingParams(max_tokens=1, detokenize=False),
                                                  f"{base}-{i}", output_kind=RequestOutputKind.FINAL_ONLY,
                                                  pooling_params=params):
            result = output
        if not isinstance(result, PoolingRequestOutput):
            raise OpenAIError("the engine returned no pooled output for this input", 500)
        return result

    tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # their generators abort the engine requests as they close
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _score_pairs(state: ServerState, pairs: list[tuple[str, str]], truncate: int | None
                       ) -> tuple[list[float], PoolingUsage]:
    if len(pairs) > MAX_POOLING_INPUTS:
        raise OpenAIError(f"at most {MAX_POOLING_INPUTS} pairs per request, got {len(pairs)}", 400)
    for pair in pairs:
        if not pair[0] or not pair[1]:
            raise OpenAIError("texts to score must not be empty", 400, param="text_1")
    config = pooler_of(state, "score")
    if config.task == "classify":
        prompts = await _prepare(state, pairs, truncate, pairs=True)
        outputs = await _run(state, prompts, PoolingParams(task="score"), "score")
        return [o.outputs.data[0] for o in outputs], _usage(outputs)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    outputs = await _run(state, await _prepare(state, texts, truncate), PoolingParams(task="embed"), "score")
    embedded = dict(zip(texts, outputs, strict=True))
    scores = [cosine_similarity(embedded[a].outputs.data, embedded[b].outputs.data) for a, b in pairs]
    return scores, _usage(outputs)


def _usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _base64(values: list[float]) -> str:
    """OpenAI's base64 encoding: little-endian float32, as numpy's tobytes."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
