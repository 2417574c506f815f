"""Linear layers that know how checkpoint tensors map onto them, and how tensor parallelism
splits them (Megatron's scheme):

    ColumnParallelLinear  W (out, in): each of the TP ranks holds out/tp rows; outputs stay split
    RowParallelLinear     W (out, in): each rank holds in/tp columns of it, takes the matching split
                          input and adds its partial product into one all-reduce

so a block `column -> elementwise -> row` (attention heads, the gated MLP) costs one all-reduce.
Fused projections (q,k,v -> qkv; gate,up -> gate_up) load each checkpoint shard into its slice of
the fused weight through `weight_loader(param, tensor, shard_id)`; each rank reads only its rows or
columns of the checkpoint tensor (`take`: a lazily read safetensors slice reads no more). At world
size 1 every layer holds everything and runs exactly as a plain linear.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtide.distributed import get_tp_group
from kvtide.layers.cpu_gemm import GemmPlan, linear


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(materialize(loaded))


def take(loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a checkpoint tensor, read from the
    file only there when it is a lazy slice (models/lazy_tensor.py). A parameter whose loader takes
    lazy slices says so with `param.reads_slices = True`; any other gets the tensor read whole."""
    if length == loaded.shape[dim] and start == 0 and isinstance(loaded, torch.Tensor):
        return loaded
    return loaded.narrow(dim, start, length)


def materialize(loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size={parts}")
    return total // parts


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        """`input_size` / `output_size`: this rank's partition (the whole layer at world size 1)."""
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.weight.reads_slices = True  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            self.bias.reads_slices = True  # type: ignore[attr-defined]
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
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's product (quantized or float), no collective: a row-parallel layer's partial sum."""
        if self.quantized is not None:
            return self.quant_method.apply(self, x, bias)
        return linear(x, self.weight, bias, self.gemm_plan)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class RowParallelLinear(LinearBase):
    """Input dimension split across the TP ranks (o_proj, down_proj): each computes a partial
    product of its input split, summed by one all-reduce; the bias is added once, after it."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp = get_tp_group()
        self.input_size_per_partition = divide(input_size, self.tp.world_size, "the row-parallel input size")
        super().__init__(self.input_size_per_partition, output_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        out = self.matmul(x, None)  # the bias once, after the sum
        self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param is self.bias:  # whole on every rank
            default_weight_loader(param, loaded)
            return
        size = self.input_size_per_partition
        default_weight_loader(param, take(loaded, 1, self.tp.rank_in_group * size, size))


class ColumnParallelLinear(LinearBase):
    """Output dimension split across the TP ranks; each keeps its output split (the next
    row-parallel layer takes it as it is)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp = get_tp_group()
        super().__init__(input_size, divide(output_size, self.tp.world_size, "the column-parallel output size"),
                         bias)

    def checkpoint_rows(self, shard_id: object) -> int:
        """The first row of this rank's part of checkpoint shard `shard_id`."""
        return self.tp.rank_in_group * self.shard_range(shard_id)[1]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        offset, size = self.shard_range(shard_id)
        target = param.data if size == param.shape[0] else param.data.narrow(0, offset, size)
        default_weight_loader(target, take(loaded, 0, self.checkpoint_rows(shard_id), size))  # type: ignore[arg-type]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column projections fused along the output dimension, e.g. [gate; up]; each rank holds
    its split of every one of them, [gate_r; up_r]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        tp = get_tp_group().world_size
        self.output_sizes = [divide(size, tp, "a merged column-parallel output size") for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias)
        self.shard_ids = tuple(range(len(output_sizes)))

    def shard_range(self, shard_id: object) -> tuple[int, int]:
        assert isinstance(shard_id, int)
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused: output rows are [q (num_heads*head_dim); k; v]. Each TP rank
    holds num_heads/tp query heads and num_kv_heads/tp KV heads; with fewer KV heads than ranks,
    each KV head is replicated on tp/num_kv_heads consecutive ranks (those whose query heads share it)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tp_group()
        self.num_heads = divide(num_heads, tp.world_size, "the attention heads")
        if num_kv_heads >= tp.world_size:
            self.num_kv_heads = divide(num_kv_heads, tp.world_size, "the KV heads")
            self.kv_head_start = tp.rank_in_group * self.num_kv_heads
        else:
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank_in_group // divide(tp.world_size, num_kv_heads, "ranks per KV head")
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp.world_size, bias)

    shard_ids = ("q", "k", "v")

    def shard_range(self, shard_id: object) -> tuple[int, int]:
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        assert shard_id in offsets, shard_id
        return offsets[shard_id]  # type: ignore[index]

    def checkpoint_rows(self, shard_id: object) -> int:
        if shard_id == "q":
            return self.tp.rank_in_group * self.q_size
        return self.kv_head_start * self.head_dim
