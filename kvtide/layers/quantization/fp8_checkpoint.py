"""FP8 checkpoints ("quant_method": "fp8", as vLLM, llm-compressor's older exports, transformers'
FineGrainedFP8 and DeepSeek-V3 write them): float8_e4m3fn weights with float32 scales, kept in FP8.

Per linear of N output and K input features:
  weight            float8_e4m3fn (N, K)
  weight_scale      float32: one per tensor (a scalar) or one per output row (N, 1)
  weight_scale_inv  float32 (ceil(N / bn), ceil(K / bk)) instead, with "weight_block_size":
                    [bn, bk]: one scale per bn x bk block (the name is DeepSeek's; it multiplies)
  input_scale       float32 scalar, with "activation_scheme": "static": the activations' FP8
                    scale, calibrated offline
and w = weight * scale of its tensor / row / block. Every variant becomes per-row group scales, which
is exact: a per-tensor scale of each shard of a fused layer is repeated over the shard's rows, and a
block scale over its bn rows and, in groups of gcd(bk, K) columns, over its bk columns.

The CPU path is weight-only (float activations times the FP8 codes), so `input_scale` is loaded and
unused there; so it is on CUDA, where Fp8Method's FP8 matmul quantizes activations per token
dynamically (and block-scaled weights take the weight-only kernel).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvtide.layers.quantization.base import (
    QuantizationConfig,
    QuantizeMethod,
    check_shard_widths,
    checkpoint_modules,
    drop_parameters,
    rank_part,
)
from kvtide.layers.quantization.fp8_method import Fp8Method
from kvtide.layers.quantization.gptq import (
    checked_parameter,
    name_matches,
)
from kvtide.layers.quantization.qweight import QuantizedWeight

ACTIVATION_SCHEMES = ("dynamic", "static")


def layer_rows(layer: nn.Module, shard_id: object) -> tuple[int, int]:
    """(offset, rows) of a shard (the whole layer for None; an LM head has no output_size)."""
    if shard_id is None:
        return 0, layer.weight_rows
    return layer.shard_range(shard_id)


def row_scale_parameter(layer: nn.Module, modules: dict[object, str], name: str, columns: int,
                        block_rows: int = 1, optional: bool = False, column_group: int = 1) -> nn.Parameter:
    """A float32 (N, columns) parameter of scales per output row, filled from whatever granularity a
    shard's checkpoint tensor has: a per-tensor scalar (repeated over the shard's rows), one per
    row ((rows,) or (rows, columns)), or one per block of `block_rows` rows
    ((ceil(rows / block_rows), columns)); a column covers `column_group` input columns.

    Under tensor parallelism a scalar is the checkpoint's, on every rank (never recomputed from
    the rank's shard); block scales are spread over their rows before a column-parallel rank
    takes its rows, so a rank's rows need not start at a block."""
    n = layer.weight_rows
    param = checked_parameter(layer, modules, "", name, (n, columns), torch.float32, output_dim=0,
                              input_dim=1, optional=optional, rank_sliced=True)
    inner = param.weight_loader  # type: ignore[attr-defined]
    tp = getattr(layer, "tp", None)
    split_rows = tp is not None and tp.world_size > 1 and hasattr(layer, "checkpoint_rows")  # column-parallel

    def weight_loader(p: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        rows = layer_rows(layer, shard_id)[1]
        if loaded.numel() == 1:
            inner(p, loaded.reshape(1, 1).expand(rows, columns).contiguous(), shard_id)
            return
        if loaded.dim() == 1 and columns == 1:
            loaded = loaded.reshape(-1, 1)
        if split_rows and block_rows > 1 and loaded.dim() == 2:
            loaded = loaded.repeat_interleave(block_rows, dim=0)
        where = modules.get(shard_id, next(iter(modules.values())))
        loaded = rank_part(layer, loaded, shard_id, (rows, columns), f"{where}.{name}", output_dim=0,
                           input_dim=1, input_pack=column_group)
        if block_rows > 1 and loaded.dim() == 2 and loaded.shape[0] == -(-rows // block_rows):
            loaded = loaded.repeat_interleave(block_rows, dim=0)[:rows]
        inner(p, loaded.contiguous(), shard_id)

    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


def fp8_weight(codes: torch.Tensor, row_scales: torch.Tensor, block_cols: int | None) -> QuantizedWeight:
    """codes float8_e4m3fn (N, K); row_scales (N, 1) or, with block_cols, (N, ceil(K / block_cols))."""
    n, k = codes.shape
    if block_cols is None:
        return QuantizedWeight("fp8", codes.view(torch.uint8), row_scales.float().contiguous(), None, k, n, k)
    group = math.gcd(block_cols, k)
    # group j spans columns [j * group, (j + 1) * group), all inside block (j * group) // block_cols
    block_of_group = torch.arange(k // group, device=codes.device) * group // block_cols
    scales = row_scales.float().index_select(1, block_of_group).contiguous()
    return QuantizedWeight("fp8", codes.view(torch.uint8), scales, None, group, n, k)


def create_fp8_weights(layer: nn.Module, modules: dict[object, str], block: tuple[int, int] | None,
                       scale_name: str, static_input: bool) -> None:
    """The parameters of an FP8 linear (shared with compressed-tensors' float-quantized format)."""
    n, k = layer.weight.shape
    layer.weight_rows = n
    drop_parameters(layer, "weight")
    hint = " (the config declares an FP8 weight)"
    checked_parameter(layer, modules, hint, "weight", (n, k), torch.float8_e4m3fn, output_dim=0, input_dim=1)
    if block is None:
        row_scale_parameter(layer, modules, scale_name, 1)
    else:
        row_scale_parameter(layer, modules, scale_name, -(-k // block[1]), block_rows=block[0],
                            column_group=block[1])
    shards = len(getattr(layer, "shard_ids", (None,)))
    # One scalar per shard; a dynamic checkpoint may still carry them (then unused as well).
    checked_parameter(layer, modules, "", "input_scale", (shards,), torch.float32, per_shard=True,
                      optional=not static_input)


class Fp8CheckpointMethod(Fp8Method):
    """Fp8Method over an FP8 checkpoint's parameters."""

    def __init__(self, modules: dict[object, str], block: tuple[int, int] | None, scale_name: str,
                 static_input: bool) -> None:
        super().__init__(self._build)
        self.modules, self.block, self.scale_name, self.static_input = modules, block, scale_name, static_input

    def create_weights(self, layer: nn.Module) -> None:
        create_fp8_weights(layer, self.modules, self.block, self.scale_name, self.static_input)

    def _build(self, layer: nn.Module) -> QuantizedWeight:
        qw = fp8_weight(layer.weight.data, getattr(layer, self.scale_name).data,
                        None if self.block is None else self.block[1])
        drop_parameters(layer, "weight", self.scale_name, "input_scale")
        return qw


class Fp8CheckpointConfig(QuantizationConfig):
    """quantization_config {"quant_method": "fp8", "activation_scheme", "weight_block_size",
    "ignored_layers" / "modules_to_not_convert", "fmt"}."""

    name = "fp8"

    def __init__(self, activation_scheme: str = "dynamic", weight_block_size: list[int] | None = None,
                 ignored_layers: list[str] | None = None) -> None:
        if activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"FP8 activation_scheme must be dynamic or static; got {activation_scheme!r}")
        if weight_block_size is not None and (len(weight_block_size) != 2 or min(weight_block_size) < 1):
            raise ValueError(f"FP8 weight_block_size must be two positive sizes [rows, columns]; got "
                             f"{weight_block_size}")
        self.activation_scheme = activation_scheme
        self.block = None if weight_block_size is None else (int(weight_block_size[0]), int(weight_block_size[1]))
        self.ignored_layers = list(ignored_layers or [])

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> Fp8CheckpointConfig:
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"FP8 checkpoints in {fmt!r} are not supported; kvtide reads float8_e4m3fn (e4m3)")
        ignored = list(qc.get("ignored_layers") or []) + list(qc.get("modules_to_not_convert") or [])
        return cls(str(qc.get("activation_scheme", "dynamic")).lower(), qc.get("weight_block_size"), ignored)


    def check_parallel(self, hf_config, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Per-tensor and per-row scales shard as they are (each rank keeps the checkpoint's scale);
        block scales need a row-parallel rank's columns to start and end at a block."""
        if tensor_parallel_size > 1 and self.block is not None:
            check_shard_widths("FP8 weight_block_size's columns", self.block[1], hf_config, tensor_parallel_size)

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        from kvtide.layers.linear import LinearBase

        if not isinstance(layer, LinearBase):  # the embedding and LM head stay float, as these exports keep them
            return None
        modules = checkpoint_modules(prefix, layer, self.shard_names)
        skipped = [any(name_matches(m, p) for p in self.ignored_layers) for m in modules.values()]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"{prefix}: the FP8 config ignores only some of the shards of this fused layer "
                             f"({', '.join(modules.values())})")
        scale_name = "weight_scale" if self.block is None else "weight_scale_inv"
        return Fp8CheckpointMethod(modules, self.block, scale_name, self.activation_scheme == "static")

    def describe(self) -> str:
        block = "" if self.block is None else f" block {self.block[0]}x{self.block[1]}"
        return f"fp8 checkpoint{block}"
