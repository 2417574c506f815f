"""The compiled CPU kernels of quantized linears (csrc/quantized_linear.cpp), with pure-torch
fallbacks for a machine without a compiler.

Decode batches (a few rows) run `quantized_linear`, which reads the weight in its quantized bytes;
larger batches dequantize the weight a slice of output rows at a time into a float32 buffer that
stays in cache and run the GEMM on it, since there the matmul's arithmetic, not the weight read,
is the cost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kvtide.attention.cpu_extension import load_cpu_op
from kvtide.attention.cpu_extension import prebuild as prebuild_cpu_op
from kvtide.layers.quantization.qweight import (
    ACTIVATION_BLOCK,
    QuantizedWeight,
    dequantize,
    quantize_activations,
)

SOURCE = Path(__file__).parent / "csrc" / "quantized_linear.cpp"
LIBRARY, WHAT = "kvtide_quant", "compiled quantized linears"
KIND_CODES = {"int8": 0, "int4": 1, "fp8": 2, "iq4": 4}
INT4_INT8_ACTIVATIONS = 3
"""The kernel's kind for int4 codes times activations quantized to int8 (QuantizedWeight.int8_activations)."""
DEQUANT_ROWS = 512
"""Output rows dequantized per GEMM on the prefill path: 512 x K float32 (1.5 MiB at K = 768)
stays in the L2/L3 cache between the write and the GEMM's read."""


_resolved: dict[str, Callable | None] = {}


def _op(name: str) -> Callable | None:
    """The compiled op `name` (None without one), resolved once: every decode linear calls it."""
    if name not in _resolved:
        _resolved[name] = load_cpu_op(SOURCE, LIBRARY, name, WHAT)
    return _resolved[name]


def prebuild() -> None:
    """This library's build for this CPU, started on a thread (cpu_extension.prebuild)."""
    prebuild_cpu_op(SOURCE, LIBRARY, WHAT)


def kernels_available() -> bool:
    return _op("quantized_linear") is not None


def op_namespace() -> str | None:
    """The torch op namespace the compiled library registered its ops under, for compiled code that
    calls `quantized_linear` itself (layers/fused_decode.py); None without a build."""
    op = _op("quantized_linear")
    return op.default.namespace if op is not None else None


def kind_code(qw: QuantizedWeight) -> int:
    """The compiled op's `kind` argument for `qw`."""
    return INT4_INT8_ACTIVATIONS if qw.int8_activations else KIND_CODES[qw.kind]


def decode_linear(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x (M, K) float32 -> (M, N): the weight read once per 4 rows of x, in its quantized bytes."""
    op = _op("quantized_linear")
    if op is None:
        return prefill_linear(x, qw) if qw.int8_activations else F.linear(x, dequantize(qw))
    out = torch.empty(x.shape[0], qw.out_features, dtype=torch.float32)
    op(out, x.contiguous(), qw.codes, qw.scales, qw.mins, kind_code(qw), qw.group_size)
    return out


def dequantize_into(out: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """Write `qw`'s float32 values into `out` (N, K) and return it."""
    op = _op("dequantize_rows")
    if op is None:
        return out.copy_(dequantize(qw))
    op(out, qw.codes, qw.scales, qw.mins, KIND_CODES[qw.kind], qw.group_size)
    return out


def prefill_linear(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) through F.linear on slices of dequantized rows. With int8
    activations, the decode kernel's arithmetic as float GEMMs: the rounded activations (d a) times
    the weight's s q, plus each group's exact sum of x times its min."""
    n = qw.out_features
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    buffer = torch.empty(min(n, DEQUANT_ROWS), qw.in_features, dtype=torch.float32)
    mins = None
    if qw.int8_activations:
        codes, d = quantize_activations(x)
        if qw.mins is not None:
            mins, group_sums = qw.mins, x.reshape(x.shape[0], -1, qw.group_size).sum(-1)
        x = (codes.view(x.shape[0], -1, ACTIVATION_BLOCK) * d.unsqueeze(-1)).view_as(x)
        qw = replace(qw, mins=None, int8_activations=False)
    for start in range(0, n, DEQUANT_ROWS):
        end = min(n, start + DEQUANT_ROWS)
        rows = dequantize_into(buffer[:end - start], qw.rows(start, end))
        out[:, start:end] = x @ rows.t()
    if mins is not None:
        out += group_sums @ mins.t()
    return out
