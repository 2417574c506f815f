"""The CPU model's compiled kernels, applied in order to a loaded model (target or draft)."""

from __future__ import annotations

import torch

from kvtide.layers.cpu_gemm import prepack_weights
from kvtide.layers.cpu_ops import use_cpu_ops
from kvtide.layers.fused_decode import fusable_linears, use_fused_decode


def use_cpu_kernels(model: torch.nn.Module, prepack_mode: str) -> None:
    """A CPU model's compiled kernels, in order: the compiled RMSNorm, rotary and SiLU-and-mul
    (layers/cpu_ops.py), packed GEMM weights (layers/cpu_gemm.py: panels preferred at decode rows
    for the linears of layers that can run fused), then one call per decoder layer at decode
    (layers/fused_decode.py), which needs both. The target and a draft model share it."""
    use_cpu_ops(model)
    prepack_weights(model, prepack_mode, prefer_panels=fusable_linears(model))
    use_fused_decode(model)
