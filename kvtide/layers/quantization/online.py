"""On-the-fly quantization of a float checkpoint at load: int8, int4 and fp8 weight-only.

The float weights load as usual; each linear (and the LM head, which on small models is a fifth of
the bytes a decode step reads, as llama.cpp's quantizers also do) is then quantized and its float
copy freed:
  int8  symmetric, one scale per output channel (max|w| / 127)
  int4  asymmetric per group of --quantization-group-size input columns (32, 64 or 128; default 128)
  fp8   float8_e4m3fn with one scale per output channel (max|w| / 448); weight-only on CPU, FP8
        activations through torch._scaled_mm on CUDA devices that have FP8 matmul (sm_89+)
  w4a8  int4's weights, and the CPU decode kernel quantizes each activation row to int8 per 32-block
        and sums the products in integers (as llama.cpp's Q4_0/Q4_1 do): about twice int4's batch-1
        speed, at the activations' rounding. Prefill batches round the activations the same way
        (float GEMMs on them); MoE experts keep float activations. CPU only.
A tied embedding shares the LM head's quantized table (looked up row by row); an untied one stays
float (a lookup reads one row per token, not the table). A MoE layer's experts are quantized the same
way, each expert's w13 and w2 on its own (layers/moe/quantized_experts.py); routers stay float.

Under tensor parallelism each rank quantizes the float shard it loaded (`quantize_shard`): rows and
int4 groups are whole on their rank, and a row-parallel rank's per-channel scale is the whole row's
max |w| (one all-gather at load), so the codes equal world size 1's. (On CUDA, fp8's per-token
activation scale in a row-parallel rank is still taken over its own columns.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvtide.layers.quantization.base import QuantizationConfig, QuantizeMethod, check_shard_widths
from kvtide.layers.quantization.qweight import (
    FP8_MAX,
    QuantizedWeight,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from kvtide.layers.quantization.weight_only import WeightOnlyMethod

INT4_GROUP_SIZES = (32, 64, 128)


class OnlineWeightOnlyMethod(WeightOnlyMethod):
    def __init__(self, quantize: Callable[[torch.Tensor], QuantizedWeight], per_channel: str | None = None) -> None:
        self.quantize = quantize
        self.per_channel = per_channel
        """'int8' / 'fp8' when `quantize` scales each output row by its max |w| (see quantize_shard)."""

    def process_weights_after_loading(self, layer: nn.Module) -> QuantizedWeight:
        return quantize_shard(layer, layer.weight.data, self.quantize, self.per_channel)


# ---- tensor parallelism: each rank quantizes its shard ------------------------------------------------
def whole_row_absmax(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """max |w| of each output row over the whole layer's input columns, (N,), for a row-parallel
    rank (None for any other layer): it holds in/tp of the columns, and a per-channel scale from
    those alone would differ from world size 1's (and between the ranks). One all-gather of (N,)."""
    tp = getattr(layer, "tp", None)
    if tp is None or tp.world_size == 1 or not hasattr(layer, "input_size_per_partition"):
        return None
    local = weight.float().abs().amax(-1, keepdim=True).contiguous()  # (N, 1)
    return tp.all_gather(local, dim=-1).amax(-1)  # (N, tp) -> (N,)


def quantize_shard(layer: nn.Module, weight: torch.Tensor, quantize: Callable[[torch.Tensor], QuantizedWeight],
                   per_channel: str | None) -> QuantizedWeight:
    """`quantize(weight)`, except that a row-parallel rank's per-channel scheme (int8, fp8) scales its
    rows by the whole rows' max |w| (the same codes and scales as world size 1's, column for column).
    Groups (int4) and column-parallel rows are whole on their rank already."""
    absmax = whole_row_absmax(layer, weight) if per_channel is not None else None
    if absmax is None:
        return quantize(weight)
    n, k = weight.shape
    w = weight.float()
    if per_channel == "int8":  # quantize_int8's arithmetic, with the whole rows' scale
        scales = (absmax.clamp_min(torch.finfo(torch.float32).tiny) / 127.0).reshape(n, 1)
        codes = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", codes, scales.contiguous(), None, k, n, k)
    scales = (absmax.clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX).reshape(n, 1)  # quantize_fp8's
    codes = (w / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantizedWeight("fp8", codes, scales.contiguous(), None, k, n, k)


def quantizes(prefix: str, layer: nn.Module) -> bool:
    """Linears and the LM head; the embedding only when the LM head shares it (tied)."""
    from kvtide.layers.embedding import LMHead, VocabEmbedding
    from kvtide.layers.linear import LinearBase

    if isinstance(layer, LinearBase | LMHead):
        return True
    return isinstance(layer, VocabEmbedding) and getattr(layer, "tied_lm_head", False)


class Int8Config(QuantizationConfig):
    name = "int8"

    def expert_quantizer(self):
        return quantize_int8

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        return OnlineWeightOnlyMethod(quantize_int8, "int8") if quantizes(prefix, layer) else None


class Int4Config(QuantizationConfig):
    name = "int4"

    def __init__(self, group_size: int | None = None) -> None:
        self.group_size = 128 if group_size is None else group_size
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}; "
                             f"got {self.group_size}")

    def check_model(self, hf_config) -> None:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        widths = [("hidden_size", hf_config.hidden_size),
                  ("intermediate_size", getattr(hf_config, "intermediate_size", hf_config.hidden_size)),
                  ("num_attention_heads * head_dim", hf_config.num_attention_heads * head_dim)]
        if getattr(hf_config, "moe_intermediate_size", None):  # Qwen-MoE, DeepSeek experts (quantized too)
            widths.append(("moe_intermediate_size", hf_config.moe_intermediate_size))
        for what, size in widths:
            if size % self.group_size:
                raise ValueError(f"int4 group size {self.group_size} does not divide the model's {what} "
                                 f"({size}); pick --quantization-group-size from "
                                 f"{', '.join(str(g) for g in INT4_GROUP_SIZES if size % g == 0) or 'none'}")

    def check_parallel(self, hf_config, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """A row-parallel rank quantizes its in/tp columns: the group must divide that width."""
        if tensor_parallel_size > 1:
            check_shard_widths("int4 group size", self.group_size, hf_config, tensor_parallel_size,
                               INT4_GROUP_SIZES)

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        group = self.group_size
        return OnlineWeightOnlyMethod(lambda w: quantize_int4(w, group)) if quantizes(prefix, layer) else None

    def expert_quantizer(self):
        group = self.group_size
        return lambda w: quantize_int4(w, group)

    def describe(self) -> str:
        return f"int4 g{self.group_size}"


class W4A8Config(Int4Config):
    name = "w4a8"

    def supported_devices(self) -> tuple[str, ...]:
        return ("cpu",)

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        group = self.group_size
        return OnlineWeightOnlyMethod(lambda w: quantize_int4(w, group, int8_activations=True)) \
            if quantizes(prefix, layer) else None

    def describe(self) -> str:
        return f"w4a8 g{self.group_size}"


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def expert_quantizer(self):
        """Weight-only fp8 codes for the experts (FP8 activations are for the dense linears on CUDA)."""
        return quantize_fp8

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        if not quantizes(prefix, layer):
            return None
        from kvtide.layers.quantization.fp8_method import Fp8Method

        return Fp8Method(lambda layer: quantize_shard(layer, layer.weight.data, quantize_fp8, "fp8"))
