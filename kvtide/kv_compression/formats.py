"""KV-cache dtypes: what `--kv-cache-dtype` names, the bytes a token takes, and the one quantized
block layout every attention backend reads.

A float dtype (float32, bfloat16, float16) keeps each backend's own layout, stored in that dtype.
The quantized dtypes share one byte layout, whatever the backend:

    kv_cache: (num_kv_heads, num_blocks, block_bytes) uint8

and inside one KV head's block of B tokens of head_dim D, four sections:

    [ K codes: B * D | V codes: B * D (int4: B * D / 2) | K params | V params ]

    fp8_e4m3 / fp8_e5m2   no params; x = float(code) * the layer's per-tensor scale (kv_scale[0] for
                          K, [1] for V: from the checkpoint, calculated, or 1.0)
    int8                  one float16 scale per token: x = code * scale, code in [-127, 127]
    int4 (V of k8v4)      float16 (scale, min) per token: x = min + code * scale, code in [0, 15];
                          byte i of a token's codes holds d = i (low nibble) and d = i + D/2 (high)

K is asymmetric-sensitive (it enters q.k, whose error the softmax exponentiates), V is only averaged:
k8v4 keeps K at 8 bits and V at 4. Per-token parameters live beside the block so a block copy, a
prefix hit or a fork carries them with the codes. The torch functions here are the reference codec:
the CPU kernel and the Triton kernels are tested against them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANT_KV_DTYPES = {"fp8": ("fp8_e4m3", "fp8_e4m3"), "fp8_e4m3": ("fp8_e4m3", "fp8_e4m3"),
                   "fp8_e5m2": ("fp8_e5m2", "fp8_e5m2"), "int8": ("int8", "int8"), "k8v4": ("int8", "int4")}
KV_CACHE_DTYPES = ("auto", *FLOAT_KV_DTYPES, *QUANT_KV_DTYPES)

KIND_IDS = {"fp8_e4m3": 0, "fp8_e5m2": 1, "int8": 2, "int4": 3}
"""Integer ids of the code kinds, as the compiled kernels take them."""
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
PARAM_BYTES = {"fp8_e4m3": 0, "fp8_e5m2": 0, "int8": 2, "int4": 4}


@dataclass(frozen=True)
class BlockLayout:
    """Byte offsets of the four sections inside one KV head's block."""

    k_codes: int
    v_codes: int
    k_params: int
    v_params: int
    block_bytes: int


@dataclass(frozen=True)
class KVQuantFormat:
    name: str
    """As the user named it, normalised: fp8_e4m3, fp8_e5m2, int8 or k8v4."""
    k_kind: str
    v_kind: str

    @property
    def uses_tensor_scales(self) -> bool:
        """Whether K or V is fp8, scaled by the layer's per-tensor kv_scale."""
        return self.k_kind in FP8_DTYPES or self.v_kind in FP8_DTYPES

    @staticmethod
    def code_bytes(kind: str, head_dim: int) -> int:
        return head_dim // 2 if kind == "int4" else head_dim

    def layout(self, block_size: int, head_dim: int) -> BlockLayout:
        k_codes = 0
        v_codes = block_size * self.code_bytes(self.k_kind, head_dim)
        k_params = v_codes + block_size * self.code_bytes(self.v_kind, head_dim)
        v_params = k_params + block_size * PARAM_BYTES[self.k_kind]
        return BlockLayout(k_codes, v_codes, k_params, v_params, v_params + block_size * PARAM_BYTES[self.v_kind])

    def bytes_per_token(self, head_dim: int) -> int:
        """K and V of one token in one KV head, parameters included."""
        return (self.code_bytes(self.k_kind, head_dim) + PARAM_BYTES[self.k_kind]
                + self.code_bytes(self.v_kind, head_dim) + PARAM_BYTES[self.v_kind])

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, num_blocks, self.layout(block_size, head_dim).block_bytes)

    # ---- the reference codec -----------------------------------------------------------------
    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              kv_scale: torch.Tensor) -> None:
        """key, value (T, H_kv, D) quantized into the slots `slot_mapping` of kv_cache; a negative
        slot is padding (CUDA-graph batches) and writes nothing."""
        num_kv_heads, num_blocks, _ = kv_cache.shape
        written = slot_mapping >= 0
        key, value, slot_mapping = key[written], value[written], slot_mapping[written]
        head_dim = key.shape[-1]
        block_size = self._block_size(kv_cache, head_dim)
        lay = self.layout(block_size, head_dim)
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        for x, kind, codes_at, params_at, scale in ((key, self.k_kind, lay.k_codes, lay.k_params, kv_scale[0]),
                                                    (value, self.v_kind, lay.v_codes, lay.v_params, kv_scale[1])):
            codes, params = quantize(x, kind, scale)
            width = codes.shape[-1]
            section = kv_cache[:, :, codes_at:codes_at + block_size * width].view(
                num_kv_heads, num_blocks, block_size, width)
            section[:, blocks, offsets] = codes.transpose(0, 1)
            if params is not None:
                pw = params.shape[-1]
                section = kv_cache[:, :, params_at:params_at + block_size * pw].view(
                    num_kv_heads, num_blocks, block_size, pw)
                section[:, blocks, offsets] = params.transpose(0, 1)

    def read_blocks(self, blocks: torch.Tensor, head_dim: int, kv_scale: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered blocks (H_kv, N, block_bytes) uint8 -> K, V (H_kv, N * block_size, D) in `dtype`."""
        num_kv_heads, num, block_bytes = blocks.shape
        block_size = block_bytes // self.bytes_per_token(head_dim)
        lay = self.layout(block_size, head_dim)
        out = []
        for kind, codes_at, params_at, scale in ((self.k_kind, lay.k_codes, lay.k_params, kv_scale[0]),
                                                 (self.v_kind, lay.v_codes, lay.v_params, kv_scale[1])):
            width, pw = self.code_bytes(kind, head_dim), PARAM_BYTES[kind]
            codes = blocks[:, :, codes_at:codes_at + block_size * width].reshape(num_kv_heads, num * block_size, width)
            params = blocks[:, :, params_at:params_at + block_size * pw].reshape(num_kv_heads, num * block_size, pw) \
                if pw else None
            out.append(dequantize(codes, params, kind, head_dim, scale).to(dtype))
        return out[0], out[1]

    def _block_size(self, kv_cache: torch.Tensor, head_dim: int) -> int:
        return kv_cache.shape[2] // self.bytes_per_token(head_dim)


def quantize(x: torch.Tensor, kind: str, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (..., D) -> codes (..., code_bytes) uint8 and per-row params (..., param_bytes) uint8 or None.
    `scale` (a 0-d float32 tensor) is the per-tensor scale the fp8 kinds divide by."""
    x = x.float()
    if kind in FP8_DTYPES:
        fp8 = FP8_DTYPES[kind]
        limit = torch.finfo(fp8).max
        return (x / scale).clamp_(-limit, limit).to(fp8).view(torch.uint8), None
    if kind == "int8":
        row_scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)
        row_scale = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
        codes = (x / row_scale.float()).round_().clamp_(-127, 127).to(torch.int8)
        return codes.view(torch.uint8), row_scale.view(torch.uint8)
    if kind == "int4":
        lo = x.amin(dim=-1, keepdim=True).to(torch.float16)
        step = ((x.amax(dim=-1, keepdim=True) - lo.float()) / 15.0).to(torch.float16)
        step = torch.where(step > 0, step, torch.ones_like(step))
        codes = ((x - lo.float()) / step.float()).round_().clamp_(0, 15).to(torch.uint8)
        half = x.shape[-1] // 2
        packed = codes[..., :half] | (codes[..., half:] << 4)
        return packed, torch.cat([step, lo], dim=-1).view(torch.uint8)
    raise ValueError(f"unknown KV code kind {kind!r}")


def dequantize(codes: torch.Tensor, params: torch.Tensor | None, kind: str, head_dim: int,
               scale: torch.Tensor) -> torch.Tensor:
    """The inverse of `quantize`: float32 (..., head_dim)."""
    if kind in FP8_DTYPES:
        return codes.view(FP8_DTYPES[kind]).float() * scale
    assert params is not None
    p = params.contiguous().view(torch.float16).float()
    if kind == "int8":
        return codes.view(torch.int8).float() * p
    if kind == "int4":
        values = torch.cat([codes & 0xF, codes >> 4], dim=-1).float()
        return p[..., 1:2] + values * p[..., 0:1]
    raise ValueError(f"unknown KV code kind {kind!r}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype | KVQuantFormat:
    """`--kv-cache-dtype` -> the float dtype of the cache, or the quantized format."""
    if name == "auto":
        return model_dtype
    if name in FLOAT_KV_DTYPES:
        return FLOAT_KV_DTYPES[name]
    if name in QUANT_KV_DTYPES:
        k_kind, v_kind = QUANT_KV_DTYPES[name]
        return KVQuantFormat("fp8_e4m3" if name == "fp8" else name, k_kind, v_kind)
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")


def kv_bytes_per_token(cache_dtype: torch.dtype | KVQuantFormat, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one token's K and V take in one layer."""
    if isinstance(cache_dtype, KVQuantFormat):
        return num_kv_heads * cache_dtype.bytes_per_token(head_dim)
    return 2 * num_kv_heads * head_dim * torch.empty((), dtype=cache_dtype).element_size()
