"""Compiled CPU versions of the decoder layer's element-wise ops (csrc/layer_ops.cpp), behind the
interfaces of their torch versions.

    RMSNorm        norm(x), or residual += x then norm(residual): one call instead of torch's
                   chain of a dozen float32 ops (pow, mean, add, rsqrt, mul, ...)
    rotary         q and k rotated in place on the fused qkv output: no cat, no temporaries
    SiluAndMul     [gate | up] -> silu(gate) * up in one pass

On a narrow model these ops cost more in per-call overhead than in arithmetic (SmolLM2: 30 layers,
576 wide), which is where most of a batch-1 decode step's non-GEMM time went. `use_cpu_ops(model)`
swaps the classes of a built model's layers, as layers/triton_ops.py does on CUDA; the model runner
applies it on the CPU when the ops compile. Inputs the ops do not take (not float32, not 2-D rows
with unit stride) go to the torch version, which stays the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtide.layers import layer_ops
from kvtide.layers.activation import SiluAndMul
from kvtide.layers.norm import RMSNorm
from kvtide.layers.rotary import RotaryEmbedding


def _takes(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1


class CpuRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if (not _takes(x) or self.weight.dtype != torch.float32
                or (residual is not None and not _takes(residual))):
            return super().forward(x, residual)
        if residual is None:
            return layer_ops.rms_norm(x, self.weight, self.eps)
        return layer_ops.add_rms_norm(x, residual, self.weight, self.eps)


class CpuRotaryEmbedding(RotaryEmbedding):
    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like RotaryEmbedding.forward, but q and k are rotated in place (and returned)."""
        cos, sin = cos_sin
        if not (_rotatable(q, cos) and _rotatable(k, cos)):
            return super().forward(cos_sin, q, k)
        return layer_ops.rotary_embedding_(q, cos, sin), layer_ops.rotary_embedding_(k, cos, sin)

    def forward_qk(self, cos_sin: tuple[torch.Tensor, torch.Tensor], qk: torch.Tensor, num_q_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        if not _rotatable(qk, cos):
            return super().forward_qk(cos_sin, qk, num_q_heads)
        layer_ops.rotary_embedding_(qk, cos, sin)
        return qk[:, :num_q_heads], qk[:, num_q_heads:]


def _rotatable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x (T, H, D) float32 with unit-stride heads, and cos_sin's (T, 1, D/2) covering all of D."""
    return (x.dtype == torch.float32 and cos.dtype == torch.float32 and x.device.type == "cpu"
            and x.dim() == 3 and x.stride(-1) == 1 and cos.shape[-1] * 2 == x.shape[-1])


class CpuSiluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _takes(x):
            return super().forward(x)
        return layer_ops.silu_and_mul(x)


# ---- applying them to a model -----------------------------------------------------------------------
_REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: CpuRMSNorm, RotaryEmbedding: CpuRotaryEmbedding, SiluAndMul: CpuSiluAndMul,
}


def use_cpu_ops(model: nn.Module) -> int:
    """Swap the class of every layer of exactly a torch type above for its compiled-op subclass
    (same parameters and buffers, same interface); returns how many were swapped, 0 when the ops
    cannot be built here (the torch versions then run)."""
    if not layer_ops.available():
        return 0
    swapped = 0
    for module in model.modules():
        replacement = _REPLACEMENTS.get(type(module))
        if replacement is not None:
            module.__class__ = replacement
            swapped += 1
    return swapped
