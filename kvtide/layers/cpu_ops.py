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

import functools
import inspect

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
"""torch layer -> its compiled-op subclass, which overrides only the methods it computes faster."""


def _compiled_methods(replacement: type[nn.Module]) -> list[str]:
    return [name for name, value in vars(replacement).items() if inspect.isfunction(value)]


def _runs_methods_of(cls: type, reference: type, names: list[str]) -> bool:
    return all(getattr(cls, name, None) is getattr(reference, name) for name in names)


def runs_compiled_ops(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether `module` is a `base` layer (RMSNorm, RotaryEmbedding or SiluAndMul) that computes
    through the compiled ops `use_cpu_ops` installed, on the inputs they take: code that calls the
    ops directly (layers/fused_decode.py) then gives the module's results bit for bit."""
    replacement = _REPLACEMENTS[base]
    return isinstance(module, replacement) and _runs_methods_of(type(module), replacement,
                                                                _compiled_methods(replacement))


@functools.cache
def _compiled_class(cls: type[nn.Module], base: type[nn.Module]) -> type[nn.Module]:
    """`base`'s compiled-op subclass for an instance of `cls`: itself for `base`, else a subclass of
    both (a model's own subclass of `base` keeps its other methods and its name)."""
    replacement = _REPLACEMENTS[base]
    if cls is base:
        return replacement
    return type(f"Cpu{cls.__name__}", (replacement, cls), {"__module__": cls.__module__})


def use_cpu_ops(model: nn.Module) -> int:
    """Swap the class of every layer that computes as a torch type above (that type, or a subclass
    that leaves the replaced methods alone) for its compiled-op subclass (same parameters and
    buffers, same interface); returns how many were swapped, 0 when the ops cannot be built here
    (the torch versions then run). A subclass with a forward of its own, a Triton or an already
    swapped layer computes otherwise and keeps its class."""
    if not layer_ops.available():
        return 0
    swapped = 0
    for module in model.modules():
        cls = type(module)
        base = next((base for base, replacement in _REPLACEMENTS.items() if isinstance(module, base)
                     and _runs_methods_of(cls, base, _compiled_methods(replacement))), None)
        if base is not None:
            module.__class__ = _compiled_class(cls, base)
            swapped += 1
    return swapped
