"""The compiled CPU layer ops of csrc/layer_ops.cpp as plain functions: RMSNorm (with the residual
add), SiLU-and-mul, rotary embedding in place, and the weight-panel linear.

Built on first use per ISA (attention/cpu_extension.load_cpu_op); `layer_op` gives None where they
cannot be (no compiler, KVTIDE_CPU_KERNELS=0) and the callers keep their torch versions.
layers/cpu_ops.py puts the element-wise ones behind the model's layer classes; layers/cpu_gemm.py
measures the panel linear against the library GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvtide.attention.cpu_extension import load_cpu_op

SOURCE = Path(__file__).parent / "csrc" / "layer_ops.cpp"
PANEL = 16
"""Output columns per weight panel of linear_panels (kPanel in layer_ops.cpp)."""

_resolved: dict[tuple[str, str | None], Callable | None] = {}


def layer_op(name: str, isa: str | None = None) -> Callable | None:
    """`torch.ops.kvtide_layers_<isa>.<name>`, built on first use; None where it cannot be."""
    key = (name, isa)
    if key not in _resolved:
        _resolved[key] = load_cpu_op(SOURCE, "kvtide_layers", name, "compiled CPU layer ops", isa)
    return _resolved[key]


def available() -> bool:
    return layer_op("rms_norm") is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    layer_op("rms_norm")(out, x, weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    layer_op("add_rms_norm")(out, x, residual, weight, eps)
    return out, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    layer_op("silu_and_mul")(out, x)
    return out


def rotary_embedding_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated in place by cos, sin (T, D/2) or (T, 1, D/2); returns x."""
    layer_op("rotary_embedding")(x, cos, sin)
    return x


# ---- weight panels for the GEMM chooser -------------------------------------------------------------
def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (ceil(N / 16), K, 16): each panel holds 16 output columns side by side for every k
    (zero-padded past N), so a small-row linear streams each panel once, front to back."""
    n, k = weight.shape
    blocks = -(-n // PANEL)
    padded = weight if n == blocks * PANEL else torch.cat([weight, weight.new_zeros(blocks * PANEL - n, k)])
    return padded.reshape(blocks, PANEL, k).transpose(1, 2).contiguous()


def linear_panels(x: torch.Tensor, n: int, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) contiguous float32 -> x @ W^T (+ bias), (M, n), from pack_panels(W)."""
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    layer_op("linear_panels")(out, x, panels, bias)
    return out
