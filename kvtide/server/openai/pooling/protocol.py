"""Request and response bodies of the pooling endpoints (vLLM's field names; OpenAI's for
/v1/embeddings, Jina's / Cohere's for rerank)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvtide.server.openai.common import OpenAIBaseModel

MAX_POOLING_INPUTS = 4096
"""Inputs (or documents, or pairs) one request may carry."""

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Truncation = Annotated[int, Field(ge=-1, le=2**31 - 1)]
PoolingInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class PoolingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Truncation | None = None
    normalize: bool | None = None
    """vLLM's extra: L2-normalize (default: the model's pooler config)."""
    add_special_tokens: bool = True


class PoolingRequest(EmbeddingRequest):
    """/pooling: the pooled output as the model's pooler makes it (vLLM's generic endpoint)."""


class ClassificationRequest(OpenAIBaseModel):
    model: str | None = None
    input: PoolingInput
    truncate_prompt_tokens: Truncation | None = None
    user: str | None = None
    activation: bool | None = None
    """False: the raw logits instead of probabilities."""


class ScoreRequest(OpenAIBaseModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Truncation | None = None
    user: str | None = None


class RerankRequest(OpenAIBaseModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    """The best `top_n` documents, best first (None or 0: all of them)."""
    return_documents: bool = True
    truncate_prompt_tokens: Truncation | None = None
    user: str | None = None


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: dict[str, Any]
    results: list[RerankResult]
