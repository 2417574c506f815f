"""GPU matmuls over quantized weights: a Triton kernel that reads `QuantizedWeight` codes as stored
(int8, packed int4, fp8) and never materializes the float weight, plus the FP8 tensor-core path.

    quantized_matmul(x, qw)   any kind, any GPU Triton runs on: each (BLOCK_M, BLOCK_N) output
                              tile loops over K, loads the codes tile, turns it into numbers and
                              multiplies it with tl.dot, applying the per-group scales/mins after
                              the dot (below). Decode (M = 1) and prefill alike.
    scaled_mm_fp8(x, w, s)    FP8 weights on FP8 hardware (compute capability >= 8.9): the
                              activations are quantized per token to FP8 and torch._scaled_mm
                              multiplies FP8 x FP8 on the tensor cores.

Why the scales come after the dot: a K tile never straddles a group (BLOCK_K divides the group
size, or the whole row is one group), so within a tile w[n, k] = s[n] * q[n, k] + min[n] and

    sum_k x[m, k] w[n, k] = s[n] * (x @ q.T)[m, n] + min[n] * sum_k x[m, k]

The codes are small integers or e4m3 values, exact in fp16/bf16, so the dot runs in x's dtype
(tensor cores for 16-bit activations) on exact inputs with a float32 accumulator; only one multiply
per output element and tile remains.

int4 bytes hold codes k0 + j (low nibble) and k0 + 16 + j (high nibble) of a 32-block (see
qweight.py). Instead of interleaving the nibbles back into k order, the kernel loads the matching
x columns twice, once for the low and once for the high half of each block, and does two dots.

fp8 codes are decoded from their bits with integer arithmetic, not by bitcasting to tl.float8e4nv:
Triton accepts fp8e4nv only on sm_89+, and fp8 checkpoints should also run on sm_80 through this
kernel (weight-only), where _scaled_mm is unavailable.

Triton is optional: without it this module still imports (quantize_per_token_fp8 and
scaled_mm_fp8 need only torch) and quantized_matmul raises when called.
"""

from __future__ import annotations

import torch

from kvtide.layers.quantization.qweight import FP8_MAX, INT4_BLOCK, QuantizedWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the kernel cannot run, the rest of the module can
    triton = None
    tl = None

KIND_IDS = {"int8": 0, "int4": 1, "fp8": 2}
"""The kind as the kernel's KIND constexpr."""

MAX_BLOCK_K = 64


def _jit(fn):
    """triton.jit when Triton is installed; otherwise the plain function (never launched)."""
    return fn if triton is None else triton.jit(fn)


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("quantized_matmul needs Triton (pip install triton); it is not installed")


# ---- the kernel ---------------------------------------------------------------------------------
@_jit
def _e4m3_to_float32(bits):
    """uint8 float8_e4m3fn bit patterns -> their float32 values (exact): sign, 4-bit exponent with
    bias 7, 3-bit mantissa; exponent 0 is subnormal (m * 2^-9), S.1111.111 is NaN (no infinities)."""
    b = bits.to(tl.int32)
    exponent = (b >> 3) & 15
    mantissa = b & 7
    # 2^(e - 10) assembled from its float32 bits (biased exponent e - 10 + 127), so that
    # (8 + m) * 2^(e - 10) = (1 + m / 8) * 2^(e - 7) is computed exactly.
    pow2 = ((exponent + 117) << 23).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125,
                         (mantissa + 8).to(tl.float32) * pow2)
    magnitude = tl.where((b & 0x7F) == 0x7F, float("nan"), magnitude)
    return tl.where(b >= 128, -magnitude, magnitude)


@_jit
def _quantized_matmul_kernel(
        x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr,
        M, N, K, group_size,
        x_stride_m, x_stride_k, codes_stride_n, codes_stride_k, scales_stride_n, scales_stride_g,
        mins_stride_n, mins_stride_g, out_stride_m, out_stride_n,
        KIND: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    col_valid = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride_m  # (BLOCK_M, 1)
    code_cols = codes_ptr + cols.to(tl.int64)[None, :] * codes_stride_n  # (1, BLOCK_N): codes read as q.T
    dot_dtype = x_ptr.dtype.element_ty  # codes are exact in it (see the module docstring)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # The tile lies in one group (BLOCK_K divides group_size, or a single group spans K).
        group = k0 // group_size
        scale = tl.load(scales_ptr + cols * scales_stride_n + group * scales_stride_g, mask=col_valid,
                        other=0.0)
        if KIND == 1:
            # int4: byte k0 // 2 + j (j < BLOCK_K / 2) holds code k_low[j] in its low nibble and
            # k_low[j] + 16 in its high one, k_low[j] = k0 + 32 * (j // 16) + j % 16. K % BLOCK_K == 0.
            HALF: tl.constexpr = BLOCK_K // 2
            j = tl.arange(0, HALF)
            k_low = k0 + (j // 16) * 32 + j % 16
            packed = tl.load(code_cols + (k0 // 2 + j)[:, None] * codes_stride_k, mask=col_valid[None, :],
                             other=0)  # (HALF, BLOCK_N) uint8
            x_low = tl.load(x_rows + k_low[None, :] * x_stride_k, mask=row_valid[:, None], other=0.0)
            x_high = tl.load(x_rows + (k_low + 16)[None, :] * x_stride_k, mask=row_valid[:, None], other=0.0)
            low = (packed & 15).to(tl.float32).to(dot_dtype)  # via float32: see the int8 branch
            high = (packed >> 4).to(tl.float32).to(dot_dtype)
            partial = tl.dot(x_low, low, input_precision=DOT_PRECISION)
            partial = tl.dot(x_high, high, partial, input_precision=DOT_PRECISION)
            if HAS_MINS:
                x_sum = tl.sum(x_low.to(tl.float32), 1) + tl.sum(x_high.to(tl.float32), 1)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            k_valid = ks < K
            raw = tl.load(code_cols + ks[:, None] * codes_stride_k, mask=k_valid[:, None] & col_valid[None, :],
                          other=0)  # (BLOCK_K, BLOCK_N) int8 codes or fp8 bits
            if KIND == 2:
                codes = _e4m3_to_float32(raw).to(dot_dtype)
            else:
                # Through float32 (exact; one extra convert once compiled): Triton's interpreter
                # casts an integer to bfloat16 by storing the integer as the raw bf16 bits.
                codes = raw.to(tl.float32).to(dot_dtype)
            x_tile = tl.load(x_rows + ks[None, :] * x_stride_k, mask=row_valid[:, None] & k_valid[None, :],
                             other=0.0)
            partial = tl.dot(x_tile, codes, input_precision=DOT_PRECISION)
            if HAS_MINS:
                x_sum = tl.sum(x_tile.to(tl.float32), 1)
        acc += partial * scale[None, :]
        if HAS_MINS:
            mins = tl.load(mins_ptr + cols * mins_stride_n + group * mins_stride_g, mask=col_valid, other=0.0)
            acc += x_sum[:, None] * mins[None, :]

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_stride_m + cols[None, :] * out_stride_n,
             acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


# ---- launching ----------------------------------------------------------------------------------
def _block_k(qw: QuantizedWeight) -> int:
    """The K tile: a power of two (16..64) that keeps every tile inside one group."""
    k, g = qw.in_features, qw.group_size
    if qw.kind == "int4":
        # Whole 32-blocks, and the int4 loop does not mask K: the tile must divide K (and g).
        return MAX_BLOCK_K if g % MAX_BLOCK_K == 0 else INT4_BLOCK
    if g == k:  # one group per row: any tile works, the last one is masked
        return min(MAX_BLOCK_K, max(16, 1 << (k - 1).bit_length()))
    block_k = min(g & -g, MAX_BLOCK_K)  # the largest power of two dividing the group size
    if block_k < 16:
        raise ValueError(f"quantized_matmul needs the group size ({g}) to be a multiple of 16 or the "
                         f"whole input dimension ({k}): tl.dot takes K tiles of 16 or more")
    return block_k


def matmul_tiling(num_rows: int, qw: QuantizedWeight) -> dict[str, int]:
    """Launch parameters. tl.dot needs every tile side >= 16, so a decode (M = 1) takes BLOCK_M 16
    and narrower column tiles (more programs across the SMs); prefill tiles are 64 x 64."""
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    return {"BLOCK_M": block_m, "BLOCK_N": 32 if num_rows <= 16 else 64, "BLOCK_K": _block_k(qw),
            "num_warps": 4, "num_stages": 3}


def quantized_matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, *,
                     tiling: dict[str, int] | None = None) -> torch.Tensor:
    """x (M, K) float32/float16/bfloat16 @ the weight qw stands for, transposed, (+ bias (N,)) ->
    (M, N) in x's dtype, accumulated in float32. `tiling` overrides matmul_tiling's entries (tests)."""
    _require_triton()
    if x.dim() != 2 or x.shape[1] != qw.in_features:
        raise ValueError(f"x must be (M, {qw.in_features}); got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float32, float16 or bfloat16; got {x.dtype}")
    if bias is not None and tuple(bias.shape) != (qw.out_features,):
        raise ValueError(f"bias must be ({qw.out_features},); got {tuple(bias.shape)}")
    if qw.input_perm is not None:  # act-order: the codes' column k multiplies x's column input_perm[k]
        x = x[:, qw.input_perm]
    m, n, k = x.shape[0], qw.out_features, qw.in_features
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    params = matmul_tiling(m, qw) | (tiling or {})
    grid = (triton.cdiv(m, params["BLOCK_M"]), triton.cdiv(n, params["BLOCK_N"]))
    mins = qw.mins if qw.mins is not None else qw.scales  # placeholders are never read
    _quantized_matmul_kernel[grid](
        x, qw.codes, qw.scales, mins, bias if bias is not None else qw.scales, out,
        m, n, k, qw.group_size,
        x.stride(0), x.stride(1), qw.codes.stride(0), qw.codes.stride(1),
        qw.scales.stride(0), qw.scales.stride(1), mins.stride(0), mins.stride(1),
        out.stride(0), out.stride(1),
        KIND=KIND_IDS[qw.kind], HAS_MINS=qw.mins is not None, HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,  # float32 stays float32, not tf32
        **params)
    return out


# ---- FP8 tensor cores ---------------------------------------------------------------------------
def fp8_matmul_supported(device: torch.device | str) -> bool:
    """Whether torch._scaled_mm runs FP8 x FP8 on `device`: NVIDIA GPUs of compute capability 8.9
    (Ada) or later. ROCm is left out: its FP8 matmul wants e4m3fnuz codes, not the e4m3fn stored."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.version.hip is None and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 9))


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token (per-row) FP8: x (..., K) -> (x_fp8 float8_e4m3fn (..., K), scale float32
    (..., 1)) with x ~= x_fp8 * scale; each row's largest magnitude maps to the FP8 maximum, 448."""
    x32 = x.float()
    # The floor keeps an all-zero row finite (its codes are 0); 1e-12 is far below any activation.
    scale = x32.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    x_fp8 = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x_fp8, scale


def scaled_mm_fp8(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (..., K) @ w.T (+ bias) with w = weight_fp8 (N, K) * weight_scale per output channel ((N,)
    or (N, 1), or one per-tensor scale), on FP8 tensor cores (see fp8_matmul_supported); weight_fp8
    is float8_e4m3fn or its uint8 bits (QuantizedWeight codes), contiguous; K and N multiples of 16."""
    out_dtype = out_dtype or x.dtype
    n, k = weight_fp8.shape
    if weight_fp8.dtype == torch.uint8:
        weight_fp8 = weight_fp8.view(torch.float8_e4m3fn)
    x_fp8, x_scale = quantize_per_token_fp8(x.reshape(-1, k))  # (M, K) row-major, scale (M, 1)
    w_scale = weight_scale.float().reshape(-1).expand(n).reshape(1, n).contiguous()  # (1, N)
    # Row-wise scaling: the second operand column-major, i.e. the (N, K) row-major weight viewed as
    # (K, N). bf16 output is what every row-wise backend supports; its rounding (2^-9) is far below
    # the activation quantization's (2^-4).
    out = torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a=x_scale, scale_b=w_scale,
                           out_dtype=torch.bfloat16).to(out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.reshape(*x.shape[:-1], n)
