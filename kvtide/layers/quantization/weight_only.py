"""Running a layer whose weight is a `QuantizedWeight`: the matmul on every device, the embedding
lookup, and the bookkeeping that keeps the quantized tensors on the layer.

CPU: up to DECODE_MAX_ROWS rows go through the compiled kernel that reads the quantized bytes
(cpu_kernels.decode_linear); more rows dequantize slices of the weight into a float32 buffer that
stays in cache and run a GEMM (cpu_kernels.prefill_linear). CUDA: the Triton kernel (triton_kernels.py) for every
batch.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtide.layers.quantization import cpu_kernels
from kvtide.layers.quantization.base import QuantizeMethod, drop_parameters
from kvtide.layers.quantization.qweight import QuantizedWeight, dequantize

DECODE_MAX_ROWS = 128
"""Rows up to which the quantized-bytes kernel is used on CPU. Measured on a Zen 4 EPYC (2 threads,
SmolLM2's shapes): it beats dequantize + GEMM up to 128 rows (at 64 rows 1.4x on the 3072x576
gate_up, 2.4x on the 49152-row LM head); from 128 rows on the GEMM's arithmetic dominates and both
run at float32 F.linear's speed."""

BUFFERS = ("qcodes", "qscales", "qmins", "qinput_perm", "qsmooth")
"""The tensors a quantized layer holds (weight_bytes counts them)."""


def install(layer: nn.Module, qw: QuantizedWeight) -> None:
    """Keep `qw` on the layer (as buffers too, so the engine counts their bytes) and drop the float
    weight the layer was created with."""
    drop_parameters(layer, "weight")
    for name, tensor in zip(BUFFERS[:4], (qw.codes, qw.scales, qw.mins, qw.input_perm), strict=True):
        layer.register_buffer(name, tensor, persistent=False)
    layer.quantized = qw


def quantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) -> (..., N) = x @ w.T (+ bias) with w the weight `qw` stands for."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if qw.input_perm is not None:
        x2 = x2.index_select(1, qw.input_perm)
    if x2.device.type == "cuda":
        from kvtide.layers.quantization.triton_kernels import quantized_matmul

        y = quantized_matmul(x2, qw, bias)
        return y.reshape(*shape[:-1], qw.out_features)
    dtype = x2.dtype
    x2 = x2.float()
    if x2.shape[0] <= DECODE_MAX_ROWS:
        y = cpu_kernels.decode_linear(x2, qw)
    else:
        y = cpu_kernels.prefill_linear(x2, qw)
    if bias is not None:
        y += bias
    return y.to(dtype).reshape(*shape[:-1], qw.out_features)


def quantized_embedding(ids: torch.Tensor, qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized table, dequantized: a lookup reads only the rows it needs."""
    flat = ids.reshape(-1)
    return dequantize(qw.gather_rows(flat), dtype).reshape(*ids.shape, qw.in_features)


class WeightOnlyMethod(QuantizeMethod):
    """Shared by every format whose kernel is the weight-only one: the format decodes, this runs."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quantized_linear(x, layer.quantized, bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return quantized_embedding(ids, layer.quantized, layer.embedding_dtype)
