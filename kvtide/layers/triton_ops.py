"""Fused Triton kernels for the element-wise layers, behind the interfaces of their torch versions.

    RMSNorm        norm(x) or (norm(x + residual), residual += x in place): one read of x and
                   residual, one write of each, instead of torch's chain of float32 temporaries
    rotary         q and k rotated in place (neox layout): no cat, no temporaries
    SiluAndMul     [gate | up] -> silu(gate) * up in one pass

Rounding follows the torch versions step by step (sum rounded to the model dtype before the norm,
norm rounded before the weight, silu rounded before the product), so bf16 results agree to the
last bit or one ulp. `use_triton_ops(model)` swaps the classes of a built model's layers (a pass
over a plain nn.Module, like gpt-fast's tensor parallel); the model runner applies it on CUDA with
the Triton attention backend. Tested against the torch versions in tests/kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from kvtide.layers.activation import SiluAndMul
from kvtide.layers.norm import RMSNorm
from kvtide.layers.rotary import RotaryEmbedding


# ---- RMSNorm (+ residual) -----------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, hidden_size, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * hidden_size
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(dtype)
        tl.store(residual_ptr + row + cols, summed, mask=mask)  # residual += x, in place
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden_size
    # Rounded to the model dtype before the weight, as transformers does (a no-op in float32).
    normed = (x * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, (weight * normed).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x (..., hidden) -> norm(x); with residual: (norm(x + residual), residual), the sum written
    into `residual` in place (RMSNorm's contract)."""
    hidden_size = x.shape[-1]
    assert weight.dtype == x.dtype, (weight.dtype, x.dtype)
    x2 = x.reshape(-1, hidden_size).contiguous()  # (rows, hidden)
    out = torch.empty_like(x2)
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape, "residual is summed in place"
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(x2.shape[0],)](x2, x2 if residual is None else residual, weight, out, hidden_size,
                                         eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                         num_warps=min(max(block // 512, 1), 16))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual


class TritonRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


# ---- rotary embedding, in place -----------------------------------------------------------------
@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, token, num_heads, half, cos, sin,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < half)
    first = x_ptr + token * stride_t + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]  (= x * cos + rotate_half(x) * sin)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(first + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                   cos_stride_t, sin_stride_t, num_q_heads, num_kv_heads, half,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    cos = tl.load(cos_ptr + token * cos_stride_t + cols, mask=col_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_stride_t + cols, mask=col_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_stride_t, q_stride_h, token, num_q_heads, half, cos, sin, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_stride_t, k_stride_h, token, num_kv_heads, half, cos, sin, BLOCK_HK, BLOCK_HALF)


def rotary_embedding_(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, H, D) and k (T, H_kv, D) in place by this step's cos, sin (T, 1, D/2) (from
    RotaryEmbedding.cos_sin); returns q, k. Views such as slices of a fused qkv are fine."""
    cos, sin = cos_sin
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, half = k.shape[1], head_dim // 2
    assert head_dim % 2 == 0 and k.shape[2] == head_dim and cos.shape[-1] == half == sin.shape[-1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            num_q_heads, num_kv_heads, half,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4)
    return q, k


class TritonRotaryEmbedding(RotaryEmbedding):
    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like RotaryEmbedding.forward, but q and k are rotated in place (and returned)."""
        return rotary_embedding_(cos_sin, q, k)

    def forward_qk(self, cos_sin: tuple[torch.Tensor, torch.Tensor], qk: torch.Tensor, num_q_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding_(cos_sin, qk[:, :num_q_heads], qk[:, num_q_heads:])


# ---- SiLU and mul --------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2d) = [gate | up] -> silu(gate) * up (..., d)."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d).contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, d, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], d)


class TritonSiluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


# ---- applying them to a model ---------------------------------------------------------------------
_REPLACEMENTS: dict[str, tuple[type[nn.Module], type[nn.Module]]] = {
    "rms_norm": (RMSNorm, TritonRMSNorm),
    "rotary": (RotaryEmbedding, TritonRotaryEmbedding),
    "silu_and_mul": (SiluAndMul, TritonSiluAndMul),
}


def use_triton_ops(model: nn.Module, ops: tuple[str, ...] = tuple(_REPLACEMENTS)) -> int:
    """Swap the class of every layer of exactly a torch type in `ops` for its Triton subclass (same
    parameters and buffers, same interface); returns how many layers were swapped. Each op is
    optional: pass a subset of ("rms_norm", "rotary", "silu_and_mul")."""
    unknown = set(ops) - set(_REPLACEMENTS)
    if unknown:
        raise ValueError(f"unknown Triton ops {sorted(unknown)}; known: {sorted(_REPLACEMENTS)}")
    swapped = 0
    for module in model.modules():
        for name in ops:
            torch_cls, triton_cls = _REPLACEMENTS[name]
            if type(module) is torch_cls:
                module.__class__ = triton_cls
                swapped += 1
    return swapped
