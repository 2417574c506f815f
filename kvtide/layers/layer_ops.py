"""The compiled CPU layer ops of csrc/layer_ops.cpp as plain functions: RMSNorm (with the residual
add), SiLU-and-mul, rotary embedding in place, the weight-panel linear and a MoE layer's experts on
weight panels.

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
from kvtide.attention.cpu_extension import prebuild as prebuild_cpu_op

SOURCE = Path(__file__).parent / "csrc" / "layer_ops.cpp"
LIBRARY, WHAT = "kvtide_layers", "compiled CPU layer ops"
PANEL = 16
"""Output columns per weight panel of linear_panels (kPanel in layer_ops.cpp)."""

_resolved: dict[tuple[str, str | None], Callable | None] = {}


def layer_op(name: str, isa: str | None = None) -> Callable | None:
    """`torch.ops.kvtide_layers_<isa>.<name>`, built on first use; None where it cannot be."""
    key = (name, isa)
    if key not in _resolved:
        _resolved[key] = load_cpu_op(SOURCE, LIBRARY, name, WHAT, isa)
    return _resolved[key]


def prebuild() -> None:
    """This library's build for this CPU, started on a thread (cpu_extension.prebuild)."""
    prebuild_cpu_op(SOURCE, LIBRARY, WHAT)


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
    """(..., N, K) -> (..., ceil(N / 16), K, 16): each panel holds 16 output columns side by side for
    every k (zero-padded past N), so a small-row linear streams each panel once, front to back.
    Leading dimensions (a MoE layer's experts) pack each matrix on its own."""
    *lead, n, k = weight.shape
    blocks = -(-n // PANEL)
    padded = weight if n == blocks * PANEL else torch.cat(
        [weight, weight.new_zeros(*lead, blocks * PANEL - n, k)], dim=-2)
    return padded.reshape(*lead, blocks, PANEL, k).transpose(-2, -1).contiguous()


def linear_panels(x: torch.Tensor, n: int, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) contiguous float32 -> x @ W^T (+ bias), (M, n), from pack_panels(W)."""
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    layer_op("linear_panels")(out, x, panels, bias)
    return out


def set_panel_prefetch(rows: int) -> None:
    """How many panel rows (64-byte lines) ahead the panel kernels prefetch; 0: none (the hardware
    prefetcher alone). Process-wide; cpu_gemm measures the best per machine."""
    layer_op("set_panel_prefetch")(rows)


def moe_experts(hidden: torch.Tensor, token_idx: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                w13_panels: torch.Tensor, w2_panels: torch.Tensor, intermediate: int) -> torch.Tensor:
    """A MoE layer's experts in one call: hidden (T, H) float32; the assignments sorted by expert,
    token_idx (A,) int64 and weights (A,) float32, expert e's rows offsets[e]:offsets[e + 1] (E + 1,),
    those past offsets[E] skipped;
    pack_panels of w13 (E, 2I, H) and w2 (E, H, I) -> (T, H): each token's weighted sum of its
    experts' w2 @ (silu(gate) * up), added in expert order."""
    out = torch.empty_like(hidden)
    layer_op("moe_experts")(out, hidden, token_idx, weights, offsets, w13_panels, w2_panels, intermediate)
    return out
