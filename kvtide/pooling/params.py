"""PoolingParams: what one pooling request asks of the pooled hidden state (vLLM's names)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

POOLING_TASKS = ("embed", "classify", "score", "encode")
"""embed: a (normalized) vector; classify: class probabilities (or raw logits); score: one relevance
value of a cross-encoded pair; encode: the pooled head output as it is."""


@dataclass
class PoolingParams:
    task: str = "embed"
    normalize: bool | None = None
    """embed: L2-normalize the vector; None: the model's pooler config decides."""
    dimensions: int | None = None
    """embed: keep the first `dimensions` values (Matryoshka), normalized after the cut."""
    use_activation: bool | None = None
    """classify / score: softmax (several labels) or sigmoid (one label) over the logits; False:
    the raw logits; None: on."""

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(POOLING_TASKS)}; got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, wire: dict[str, Any] | PoolingParams | None) -> PoolingParams | None:
        """Back from a msgpack dict (validated again); a PoolingParams or None passes through."""
        if wire is None or isinstance(wire, PoolingParams):
            return wire
        return cls(**wire)
