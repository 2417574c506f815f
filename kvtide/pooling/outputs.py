"""What pooling requests return, with vLLM's class and field names.

The engine yields PoolingRequestOutput (the pooled vector as floats); `LLM.embed`, `classify` and
`score` wrap it in the task's class, whose `outputs` names the value as the task calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PoolingOutput:
    data: list[float]


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]
    """Class probabilities (softmax; sigmoid for one label), or the raw logits without activation."""

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def cosine_similarity(a: list[float], b: list[float]) -> float:
    """How embedding models score a pair (the API side has no torch)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0
