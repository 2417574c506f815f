"""FP8 (float8_e4m3fn) weights: FP8 x FP8 matmuls where the device has them, weight-only elsewhere.

On CUDA devices with FP8 tensor cores (compute capability 8.9+: Ada, Hopper) the activations are
quantized per token and torch._scaled_mm multiplies in FP8; everywhere else (CPU, older GPUs) the
e4m3 codes are read by the weight-only kernels with float activations. Used by on-the-fly
`--quantization fp8` and by FP8 checkpoints alike; the format decides only how `QuantizedWeight`
is built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvtide.layers.quantization.qweight import QuantizedWeight
from kvtide.layers.quantization.weight_only import WeightOnlyMethod, quantized_linear


class Fp8Method(WeightOnlyMethod):
    def __init__(self, build: Callable[[nn.Module], QuantizedWeight]) -> None:
        self.build = build
        """Turns the layer's loaded parameters into an fp8 QuantizedWeight with per-channel scales."""

    def process_weights_after_loading(self, layer: nn.Module) -> QuantizedWeight:
        qw = self.build(layer)
        if bool(((qw.codes & 0x7F) == 0x7F).any()):  # e4m3fn's NaN codes
            raise ValueError("an fp8 weight holds NaN codes: the checkpoint is corrupt")
        return qw

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qw: QuantizedWeight = layer.quantized
        if x.device.type == "cuda" and qw.input_perm is None and qw.group_size == qw.in_features:
            from kvtide.layers.quantization.triton_kernels import fp8_matmul_supported, scaled_mm_fp8

            if fp8_matmul_supported(x.device):
                shape = x.shape
                y = scaled_mm_fp8(x.reshape(-1, shape[-1]), qw.codes.view(torch.float8_e4m3fn),
                                  qw.scales, bias, out_dtype=x.dtype)
                return y.reshape(*shape[:-1], qw.out_features)
        return quantized_linear(x, qw, bias)
