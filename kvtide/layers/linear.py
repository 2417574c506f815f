"""Linear layers that know how checkpoint tensors map onto them.

Fused projections (q,k,v -> qkv; gate,up -> gate_up) load each checkpoint shard into its slice of
the fused weight through `weight_loader(param, tensor, shard_id)`. With tensor parallelism these
classes are where a rank would take its slice; at world size 1 they hold everything.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtide.layers.cpu_gemm import GemmPlan, linear


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.gemm_plan: GemmPlan | None = None
        """On CPU, the GEMM kernel measured fastest per row count, with its packed copy of `weight`
        (layers/cpu_gemm.py); None: F.linear."""
        self.quant_method = None
        """Set when the layer is quantized (layers/quantization/): it runs the matmul once the layer
        holds its QuantizedWeight (`quantized`; until then, e.g. while calibrating, the float weight)."""
        self.quantized = None

    shard_ids: tuple[object, ...] = (None,)
    """The checkpoint shards fused into this layer, in output-row order."""

    def shard_range(self, shard_id: object) -> tuple[int, int]:
        """(offset, size) in output rows of one checkpoint shard."""
        return 0, self.output_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quant_method.apply(self, x, self.bias)
        return linear(x, self.weight, self.bias, self.gemm_plan)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks (o_proj, down_proj); whole at world size 1."""


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks; whole at world size 1."""


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column projections fused along the output dimension, e.g. [gate; up]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))

    def shard_range(self, shard_id: object) -> tuple[int, int]:
        assert isinstance(shard_id, int)
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        offset, size = self.shard_range(shard_id)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)  # type: ignore[arg-type]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused: output rows are [q (num_heads*head_dim); k; v]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    shard_ids = ("q", "k", "v")

    def shard_range(self, shard_id: object) -> tuple[int, int]:
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        assert shard_id in offsets, shard_id
        return offsets[shard_id]  # type: ignore[index]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        offset, size = self.shard_range(shard_id)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)  # type: ignore[arg-type]
