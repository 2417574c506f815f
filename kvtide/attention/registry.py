"""Attention backends by name (`--attention-backend`): the one place that knows them all, so the
interface (backend.py) stays below every backend that implements it."""

from __future__ import annotations

from kvtide.attention.backend import AttentionBackend
from kvtide.kv_compression.formats import KVQuantFormat


def get_attention_backend(name: str, kv_quant: KVQuantFormat | None = None) -> AttentionBackend:
    """The backend called `name`, imported only when asked for: a CPU install never imports Triton."""
    if name == "cpu":
        from kvtide.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(kv_quant)
    if name == "torch":
        from kvtide.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_quant)
    if name == "torch_ref":
        from kvtide.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend(kv_quant)
    if name == "triton":
        from kvtide.attention.triton_backend import TritonAttentionBackend  # type: ignore[import-not-found]

        return TritonAttentionBackend(kv_quant)
    raise ValueError(f"attention_backend must be one of auto, cpu, torch, torch_ref, triton; got {name!r}")
