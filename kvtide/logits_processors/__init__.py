"""Logits processors: batch-level plug-ins that rewrite the logits before sampling (vLLM v1's
interface, so processors written for it carry over)."""

from kvtide.logits_processors.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest",
           "RemovedRequest"]
