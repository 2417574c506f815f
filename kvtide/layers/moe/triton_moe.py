"""The MoE experts on CUDA as two Triton grouped GEMMs (the design of vLLM's fused_moe kernel):

  1. align    the T * k assignments sorted by expert, each expert's run padded to a multiple of
              BLOCK_M with the sentinel T * k, so that every BLOCK_M rows of the sorted list belong
              to one expert (block_expert[b]); done in torch, with no host sync:

                 topk_ids [[2, 0], [0, 3]], BLOCK_M 2 (sentinel 4)
                 sorted_ids    [1, 2 | 0, 4 | 3, 4]  (the experts' runs: e0 | e2 | e3)
                 block_expert  [0, 2, 3, E, ...]     (E past the end: those programs return)

              The grid is the upper bound ceil(T * k / BLOCK_M) + E row blocks, so its size is
              known without reading the counts back.
  2. GEMM 1   program (b, n): C1[a, n-tile] = hidden[a // k] @ w13[block_expert[b]].T for the
              BLOCK_M assignments a of block b (sentinel rows masked), accumulated in float32.
  3. SiLU-and-mul in torch: act (T * k, I).
  4. GEMM 2   C2[a] = (act[a] @ w2[e].T) * topk_weights[a], the weight applied to the float32
              accumulator before the store; rows of skipped assignments stay 0.
  5. sum over k: C2 (T, k, H).sum(1).

Ids equal to E (capacity drops, experts elsewhere) are left out, as in fused_experts. Tested against
fused_experts under TRITON_INTERPRET=1 (tests/kernels/test_triton_moe.py); compiled for sm_90 by
tests/kernels/compile_check.py.

Triton is optional: without it this module still imports and the kernel raises when called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install
    triton = None
    tl = None


def _jit(fn):
    """triton.jit when Triton is installed; otherwise the plain function (never launched)."""
    return fn if triton is None else triton.jit(fn)


@_jit
def _grouped_gemm_kernel(
        a_ptr, w_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, block_expert_ptr,
        N, K, num_assignments, num_experts, a_row_divisor,
        a_stride_m, a_stride_k, w_stride_e, w_stride_n, w_stride_k, c_stride_m, c_stride_n,
        MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    """C[a, :] = A[a // a_row_divisor, :] @ W[e].T (* topk_weights[a]) for one (BLOCK_M, BLOCK_N)
    tile of the sorted assignments a of one expert e."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:  # past the last expert's padded run
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # (BLOCK_M,)
    row_valid = assignment < num_assignments
    a_rows = a_ptr + (assignment // a_row_divisor)[:, None] * a_stride_m  # (BLOCK_M, 1)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    w_cols = w_ptr + expert * w_stride_e + cols.to(tl.int64)[None, :] * w_stride_n  # (1, BLOCK_N): W[e].T

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a_tile = tl.load(a_rows + ks[None, :] * a_stride_k, mask=row_valid[:, None] & k_valid[None, :],
                         other=0.0)  # (BLOCK_M, BLOCK_K)
        w_tile = tl.load(w_cols + ks[:, None] * w_stride_k, mask=k_valid[:, None] & col_valid[None, :],
                         other=0.0)  # (BLOCK_K, BLOCK_N)
        acc = tl.dot(a_tile, w_tile, acc, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        weight = tl.load(topk_weights_ptr + assignment, mask=row_valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    tl.store(c_ptr + assignment[:, None] * c_stride_m + cols[None, :] * c_stride_n,
             acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def align_assignments(topk_ids: torch.Tensor, num_experts: int, block_m: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids (T, k) -> (sorted_ids (num_blocks * block_m,) int32, block_expert (num_blocks,) int32)
    with num_blocks = ceil(T * k / block_m) + E, the bound on the blocks the padded runs take.

    sorted_ids: the assignments (t * k + j) grouped by expert in token order, each expert's run
    padded to a multiple of block_m with T * k; block_expert[b]: the expert of rows
    [b * block_m, (b + 1) * block_m), E for blocks past the last run. Ids equal to E are left out."""
    num_assignments = topk_ids.numel()
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1)
    num_blocks = -(-num_assignments // block_m) + num_experts
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts]  # (E,)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat_ids, stable=True)
    sorted_experts = flat_ids[order]
    local = sorted_experts.clamp_max(num_experts - 1)
    rank = torch.arange(num_assignments, device=device) - starts[local]
    slot = padded_ends[local] - padded[local] + rank
    slot = torch.where(sorted_experts < num_experts, slot, num_blocks * block_m)  # id E: the spare slot
    sorted_ids = torch.full((num_blocks * block_m + 1,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, slot, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return sorted_ids[:-1], block_expert


def moe_tiling(num_assignments: int, num_experts: int) -> dict[str, int]:
    """tl.dot takes tiles of >= 16 a side: BLOCK_M 16 when the experts get few rows each (decode),
    up to 64 for prefill."""
    rows_per_expert = num_assignments / num_experts
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor | None,
                  sorted_ids: torch.Tensor, block_expert: torch.Tensor, a_row_divisor: int,
                  params: dict[str, int]) -> None:
    num_experts, n, k = w.shape
    block_m = params["BLOCK_M"]
    grid = (block_expert.shape[0], triton.cdiv(n, params["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a, w, out, topk_weights if topk_weights is not None else out, sorted_ids, block_expert,
        n, k, out.shape[0], num_experts, a_row_divisor,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        MUL_WEIGHT=topk_weights is not None, BLOCK_M=block_m, BLOCK_N=params["BLOCK_N"],
        BLOCK_K=params["BLOCK_K"], DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        num_warps=params["num_warps"], num_stages=params["num_stages"])


def triton_fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                         tiling: dict[str, int] | None = None) -> torch.Tensor:
    """fused_experts' contract (fused_moe.py) through the grouped GEMMs: hidden (T, H), w13 (E, 2I, H),
    w2 (E, H, I), topk_* (T, k) -> (T, H). `tiling` overrides moe_tiling's entries (tests)."""
    if triton is None:
        raise RuntimeError("triton_fused_experts needs Triton (pip install triton); it is not installed")
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    if hidden_states.shape != (num_tokens, hidden_size) or w2.shape != (num_experts, hidden_size, two_i // 2):
        raise ValueError(f"shapes do not agree: hidden {tuple(hidden_states.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, topk_ids {tuple(topk_ids.shape)}")
    num_assignments = num_tokens * top_k
    if num_assignments == 0:
        return torch.zeros_like(hidden_states)
    hidden_states = hidden_states.contiguous()
    params = moe_tiling(num_assignments, num_experts) | (tiling or {})
    sorted_ids, block_expert = align_assignments(topk_ids, num_experts, params["BLOCK_M"])
    dtype, device = hidden_states.dtype, hidden_states.device
    gate_up = torch.empty((num_assignments, two_i), dtype=dtype, device=device)
    _grouped_gemm(hidden_states, w13, gate_up, None, sorted_ids, block_expert, top_k, params)
    intermediate = two_i // 2
    act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]  # (T * k, I); skipped rows unused
    down = torch.zeros((num_assignments, hidden_size), dtype=dtype, device=device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(act, w2, down, weights, sorted_ids, block_expert, 1, params)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1)
