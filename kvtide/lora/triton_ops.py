"""The batched LoRA op as two Triton kernels (ops.py's torch op is the reference): a segmented
shrink and a segmented expand over the tokens grouped by adapter slot (ops.LoRAStepGroups).

    shrink  grid (segment, row block, rank block):  h[start + m] = x[perm[start + m]] @ A[slot].T
    expand  grid (segment, row block, out block),   y[perm[start + m], offset + n] +=
            once per shard:                             h[start + m, i R : i R + r] @ B[slot, offset + n].T

Each token is in one segment, so every output element is written by one program (no atomics). The
tiles are multiplied in float32 ("ieee": float32 stays float32, never tf32) whatever the dtype.
Triton is optional: without it this module imports and `add_lora_triton` refuses to run.
"""

from __future__ import annotations

import torch

from kvtide.lora.ops import LoRAStepGroups

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the kernels cannot run, the module still imports
    triton = None
    tl = None

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


def _jit(fn):
    """triton.jit when Triton is installed; otherwise the plain function (never launched)."""
    return fn if triton is None else triton.jit(fn)


@_jit
def _shrink_kernel(x_ptr, perm_ptr, a_ptr, h_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                   K, N, stride_xm, stride_as, stride_an, stride_hm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < length
    n_mask = offs_n < N
    rows = tl.load(perm_ptr + start + offs_m, mask=m_mask, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + offs_n[None, :] * stride_an + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(x, a, input_precision="ieee")
    tl.store(h_ptr + (start + offs_m)[:, None] * stride_hm + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


@_jit
def _expand_kernel(h_ptr, perm_ptr, b_ptr, y_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                   h_col, R, out_offset, size, stride_hm, stride_bs, stride_bo, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < length
    n_mask = offs_n < size
    r_mask = offs_r < R
    rows = tl.load(perm_ptr + start + offs_m, mask=m_mask, other=0)
    h = tl.load(h_ptr + (start + offs_m)[:, None] * stride_hm + h_col + offs_r[None, :],
                mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + (out_offset + offs_n)[None, :] * stride_bo + offs_r[:, None],
                mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.dot(h, b, input_precision="ieee")
    mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + out_offset + offs_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    groups: LoRAStepGroups, out_slices: list[tuple[int, int]]) -> torch.Tensor:
    """ops.add_lora's contract, in two kernels: y + every grouped token's LoRA delta, as a new tensor."""
    if triton is None:
        raise RuntimeError("add_lora_triton needs Triton (pip install triton); it is not installed")
    x, lora_a, lora_b = x.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    out = y.contiguous().clone()
    device = x.device
    starts = torch.tensor([s for _, s, _ in groups.segments], dtype=torch.int32, device=device)
    lens = torch.tensor([e - s for _, s, e in groups.segments], dtype=torch.int32, device=device)
    slots = torch.tensor([slot for slot, _, _ in groups.segments], dtype=torch.int32, device=device)
    perm = groups.perm.to(device=device, dtype=torch.int64)
    num_lora_tokens, num_segments = int(perm.shape[0]), len(groups.segments)
    longest = max(e - s for _, s, e in groups.segments)
    rank = lora_b.shape[-1]
    shrunk_cols = lora_a.shape[1]
    h = torch.empty(num_lora_tokens, shrunk_cols, dtype=torch.float32, device=device)
    row_blocks = triton.cdiv(longest, BLOCK_M)
    _shrink_kernel[(num_segments, row_blocks, triton.cdiv(shrunk_cols, BLOCK_N))](
        x, perm, lora_a, h, starts, lens, slots, x.shape[1], shrunk_cols, x.stride(0), lora_a.stride(0),
        lora_a.stride(1), h.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    block_r = max(16, triton.next_power_of_2(rank))
    for i, (offset, size) in enumerate(out_slices):
        _expand_kernel[(num_segments, row_blocks, triton.cdiv(size, BLOCK_N))](
            h, perm, lora_b, out, starts, lens, slots, i * rank, rank, offset, size, h.stride(0),
            lora_b.stride(0), lora_b.stride(1), out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r)
    return out
