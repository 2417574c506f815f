"""The one in-memory layout every quantized linear is converted to at load, whatever its source format.

GPTQ, AWQ, compressed-tensors, FP8 checkpoints, GGUF blocks and on-the-fly quantization each decode
their own packing once, at load, into a `QuantizedWeight`; the kernels (the compiled CPU op, the
Triton kernels, the dequantize-then-GEMM prefill path) read only this layout:

    w[n, k] = scales[n, k // group_size] * code[n, k] + (mins[n, k // group_size] if mins else 0)

kinds and their `codes` tensor, for an (N, K) weight:
  int8  int8  (N, K): signed codes, -128..127 (GPTQ 8-bit, Q8_0, Q5_K and Q6_K codes all fit)
  int4  uint8 (N, K // 2): unsigned codes 0..15, two per byte. K is cut into blocks of 32; in the
        block starting at k0, byte k0 // 2 + j holds code k0 + j in its low nibble and code
        k0 + 16 + j in its high nibble (j < 16): one 16-byte load yields 32 consecutive codes.
  fp8   uint8 (N, K): float8_e4m3fn bit patterns (the code is that float's value)
  iq4   uint8 (N, K // 2): int4's nibbles in int4's order, each an index into IQ4_LEVELS (the code
        is that level): GGUF's IQ4_NL / IQ4_XS grid, kept at half a byte a weight.

`scales`/`mins` are float32 (N, K // group_size); group_size divides K (K for per-channel). An
int4 or iq4 weight needs K % 32 == 0 and group_size % 32 == 0 (a group never splits a 32-block) or
group_size 16 (GGUF's Q2_K/Q3_K sub-blocks: a block's low nibbles one group, its high nibbles the
next; weight-only: int8 activations need whole blocks). int8 takes any group size (Q6_K's 16). `input_perm` (K,) int64, when set, says the codes'
column k holds the checkpoint's input column input_perm[k]: the layer computes
x[:, input_perm] @ w.T (GPTQ act-order, whose groups are contiguous only after that sort).
`int8_activations` (int4 only) asks the CPU kernels to round the activations to int8 per 32-block
(`quantize_activations`) and sum each block's products in integers: what llama.cpp's Q4_0 does, at
a cost in accuracy the user opts into (--quantization w4a8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("int8", "int4", "fp8", "iq4")
NIBBLE_KINDS = ("int4", "iq4")
"""Kinds whose codes are nibbles, two a byte in the 32-block order."""
INT4_BLOCK = 32
IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                          dtype=torch.int8)
"""The 16 levels an iq4 code indexes (ggml's IQ4_NL grid, shared by IQ4_XS): denser near zero, so a
4-bit code spends its levels where trained weights lie."""


@dataclass
class QuantizedWeight:
    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int
    out_features: int
    in_features: int
    input_perm: torch.Tensor | None = None
    int8_activations: bool = False

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.kind not in KINDS:
            raise ValueError(f"quantized weight kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if g < 1 or k % g:
            raise ValueError(f"group size {g} does not divide the input dimension {k}")
        if self.kind in NIBBLE_KINDS and (k % INT4_BLOCK or (g % INT4_BLOCK and g != INT4_BLOCK // 2)):
            raise ValueError(f"{self.kind} weights need the input dimension ({k}) and group size ({g}) to be "
                             f"multiples of {INT4_BLOCK} (or a group size of {INT4_BLOCK // 2})")
        codes_shape = (n, k // 2) if self.kind in NIBBLE_KINDS else (n, k)
        codes_dtype = torch.int8 if self.kind == "int8" else torch.uint8
        if tuple(self.codes.shape) != codes_shape or self.codes.dtype != codes_dtype:
            raise ValueError(f"{self.kind} codes must be {codes_dtype} {codes_shape}; got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is not None and (tuple(t.shape) != (n, k // g) or t.dtype != torch.float32):
                raise ValueError(f"{name} must be float32 {(n, k // g)}; got {t.dtype} {tuple(t.shape)}")
        if self.int8_activations and self.kind != "int4":
            raise ValueError(f"int8 activations are implemented for int4 weights, not {self.kind}")
        if self.int8_activations and g % INT4_BLOCK:
            raise ValueError(f"int8 activations need int4 groups that are multiples of {INT4_BLOCK}; got {g}")
        if self.input_perm is not None and tuple(self.input_perm.shape) != (k,):
            raise ValueError(f"input_perm must have {k} entries; got {tuple(self.input_perm.shape)}")

    @property
    def nbytes(self) -> int:
        """Bytes the layer keeps for its weight (codes, scales, mins, permutation)."""
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins, self.input_perm) if t is not None)

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Output rows [start, end) (views): the slices the prefill path dequantizes one at a time."""
        return QuantizedWeight(self.kind, self.codes[start:end], self.scales[start:end],
                               None if self.mins is None else self.mins[start:end], self.group_size,
                               end - start, self.in_features, self.input_perm, self.int8_activations)

    def gather_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The output rows `index` (copies): an embedding lookup in a quantized table."""
        return QuantizedWeight(self.kind, self.codes[index], self.scales[index],
                               None if self.mins is None else self.mins[index], self.group_size,
                               int(index.numel()), self.in_features, self.input_perm, self.int8_activations)


# ---- codes <-> values ------------------------------------------------------------------------
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 (any integer dtype) -> (N, K // 2) uint8 in the 32-block nibble order."""
    n, k = codes.shape
    if k % INT4_BLOCK:
        raise ValueError(f"int4 packing needs K % {INT4_BLOCK} == 0; got K={k}")
    blocks = codes.to(torch.uint8).reshape(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: (N, K // 2) uint8 -> (N, K) uint8 codes."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // (INT4_BLOCK // 2), 1, INT4_BLOCK // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(n, half * 2)


def code_values(qw: QuantizedWeight) -> torch.Tensor:
    """The codes as float32 (N, K) numbers."""
    if qw.kind == "int4":
        return unpack_int4(qw.codes).float()
    if qw.kind == "iq4":
        return IQ4_LEVELS.to(qw.codes.device)[unpack_int4(qw.codes).long()].float()
    if qw.kind == "fp8":
        return qw.codes.view(torch.float8_e4m3fn).float()
    return qw.codes.float()


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (N, K) weight the codes stand for, in the checkpoint's input-column order undone: columns
    stay in the codes' order (apply input_perm to x, not here). The reference every kernel meets."""
    n, k, g = qw.out_features, qw.in_features, qw.group_size
    values = code_values(qw).view(n, k // g, g) * qw.scales.unsqueeze(-1)
    if qw.mins is not None:
        values = values + qw.mins.unsqueeze(-1)
    return values.view(n, k).to(dtype)


ACTIVATION_BLOCK = 32
"""Activations rounded to int8 share one scale per this many consecutive inputs (one int4 block)."""


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (codes (M, K) float32 integers in -127..127, d (M, K // 32)): per 32-block
    d = max|x| / 127 and code = round(x * (127 / max|x|)), ties to even (0 for an all-zero block)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127)
    return codes.reshape(m, k), amax / 127.0


# ---- float -> codes (on-the-fly quantization) ------------------------------------------------
def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8: per output channel (group_size None) or per group, scale = max|w| / 127."""
    n, k = weight.shape
    g = group_size or k
    w = weight.float().reshape(n, k // g, g) if k % g == 0 else None
    if w is None:
        raise ValueError(f"group size {g} does not divide the input dimension {k}")
    scales = w.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    codes = torch.round(w / scales.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedWeight("int8", codes, scales.contiguous(), None, g, n, k)


def quantize_int4(weight: torch.Tensor, group_size: int = 128, int8_activations: bool = False) -> QuantizedWeight:
    """Asymmetric int4 per group: codes 0..15 spanning [min, max] of the group, w = s * q + min."""
    n, k = weight.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    w = weight.float().reshape(n, k // group_size, group_size)
    lo = w.amin(-1).clamp_max(0.0)
    hi = w.amax(-1).clamp_min(0.0)
    scales = ((hi - lo) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round((w - lo.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, 15).reshape(n, k)
    return QuantizedWeight("int4", pack_int4(codes), scales.contiguous(), lo.contiguous(), group_size, n, k,
                           int8_activations=int8_activations)


FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
    """float8_e4m3fn per output channel: scale = max|w| / 448."""
    n, k = weight.shape
    w = weight.float()
    scales = (w.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX)
    codes = (w / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantizedWeight("fp8", codes, scales.contiguous(), None, k, n, k)


def promote(qw: QuantizedWeight, kind: str, group_size: int) -> QuantizedWeight:
    """The same values in a wider kind or finer groups (int4 or iq4 -> int8, group 32 -> 16): what
    lets the shards of one fused layer stored in different formats (a GGUF Q4_K q beside a Q6_K v)
    share one kernel call. Codes and per-group numbers are copied; int4 -> int8 moves a shift of 8
    into the mins, which changes a value by float32 rounding at most; iq4 -> int8 writes the levels
    as the codes (exact)."""
    if group_size > qw.group_size or qw.group_size % group_size:
        raise ValueError(f"cannot regroup group size {qw.group_size} into {group_size}")
    if (qw.kind, kind) not in (("int4", "int8"), ("int4", "int4"), ("int8", "int8"), ("fp8", "fp8"),
                               ("iq4", "int8"), ("iq4", "iq4")):
        raise ValueError(f"cannot promote a {qw.kind} weight to {kind}")
    repeat = qw.group_size // group_size
    scales = qw.scales.repeat_interleave(repeat, dim=1)
    mins = None if qw.mins is None else qw.mins.repeat_interleave(repeat, dim=1)
    codes = qw.codes
    if qw.kind == "int4" and kind == "int8":
        # int8 codes are signed: shift by -8 and carry the shift in the mins.
        codes = (unpack_int4(qw.codes).to(torch.int16) - 8).to(torch.int8)
        mins = (scales * 8.0) if mins is None else mins + scales * 8.0
    elif qw.kind == "iq4" and kind == "int8":
        codes = IQ4_LEVELS.to(qw.codes.device)[unpack_int4(qw.codes).long()]
    return QuantizedWeight(kind, codes, scales, mins, group_size, qw.out_features, qw.in_features,
                           qw.input_perm)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack the shards of a fused layer ([q; k; v], [gate; up]) into one weight; they must share a
    kind, group size and input permutation (promote first)."""
    first = parts[0]
    for p in parts[1:]:
        if (p.kind, p.group_size, p.in_features) != (first.kind, first.group_size, first.in_features):
            raise ValueError("fused shards differ in kind, group size or input size; promote them first")
        if (p.input_perm is None) != (first.input_perm is None) or (
                p.input_perm is not None and not torch.equal(p.input_perm, first.input_perm)):
            raise ValueError("the shards of a fused layer have different act-order permutations (g_idx); "
                             "kvtide runs a fused projection as one kernel and cannot apply two")
    has_mins = any(p.mins is not None for p in parts)
    mins = torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts]) \
        if has_mins else None
    return QuantizedWeight(first.kind, torch.cat([p.codes for p in parts]),
                           torch.cat([p.scales for p in parts]), mins, first.group_size,
                           sum(p.out_features for p in parts), first.in_features, first.input_perm,
                           all(p.int8_activations for p in parts))
