"""A MoE layer's experts in a GPTQ or AWQ checkpoint (Mixtral-, Qwen-MoE-, DeepSeek-GPTQ/AWQ exports).

The checkpoint holds every expert's projections as packed-integer tensors of their own, named like
the float ones (`experts.{e}.w1.qweight`, `.qzeros`, `.scales`, GPTQ's `.g_idx`; gate_proj /
up_proj / down_proj in Qwen and DeepSeek). They load into FusedMoE as stacked parameters, one per
projection and tensor kind, each expert's tensors as the format lays out one linear's (gptq.py,
awq.py), with the output columns last:

    w13_qweight (E, ..., 2I or 2I / pack)   w1 in the first half of the output columns, w3 in the second
    w13_qzeros, w13_scales                  the same halves
    w13_g_idx   (E, 2, H)                   GPTQ: w1's and w3's (act-order); they must agree
    w2_*                                    (H, I), g_idx (E, 1, I)

so a shard's columns are a contiguous half (I must be a multiple of the values packed per int32).
After loading, each expert's w13 and w2 become QuantizedWeights (decoded like a linear of the
format), stacked into the layer's QuantizedExperts, and the experts run through the weight-only
kernels like on-the-fly quantized experts. w1 and w3 read the same input, so GPTQ's act-order gives
them one permutation; kvtide runs them as one fused GEMM and refuses a checkpoint where they differ.
Tensor-parallel experts (each rank a slice of every expert) are refused; expert parallelism loads
each rank's experts only.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtide.layers.quantization.base import drop_parameters, loaded
from kvtide.layers.quantization.qweight import QuantizedWeight

SHARDS = {"w13": ("w1", "w3"), "w2": ("w2",)}


class PackedExpertsMethod:
    """Creates a FusedMoE's parameters in the format, loads each expert's tensors into them, and
    converts them into QuantizedWeights once loading ends. Subclasses give the format's shapes
    and its decoding (gptq.GPTQExpertsMethod, awq.AWQExpertsMethod, beside the format's decoder)."""

    format_name = ""
    bits = 4
    optional: frozenset[str] = frozenset()
    """Tensor kinds a checkpoint may lack."""

    def __init__(self, group_size: int, where: str) -> None:
        self.group_size, self.where = group_size, where

    def tensor_shapes(self, n: int, k: int, group: int, shards: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """One expert's tensors of a projection with n outputs (all shards) and k inputs."""
        raise NotImplementedError

    def decode(self, tensors: dict[str, torch.Tensor], group: int, where: str) -> QuantizedWeight:
        """One expert's tensors of a projection -> its QuantizedWeight."""
        raise NotImplementedError

    def create_weights(self, moe: nn.Module) -> None:
        if moe.tp_size > 1:
            raise ValueError(f"{self.where}: {self.format_name} experts split over tensor-parallel ranks are not "
                             f"supported; use --enable-expert-parallel or tensor_parallel_size=1")
        pack = 32 // self.bits
        experts, hidden, inter = moe.local_num_experts, moe.hidden_size, moe.local_intermediate_size
        self.groups: dict[str, int] = {}
        for proj, (n, k) in {"w13": (2 * inter, hidden), "w2": (hidden, inter)}.items():
            group = k if self.group_size == -1 else self.group_size
            if k % group:
                raise ValueError(f"{self.where}: {self.format_name} group_size {group} does not divide the experts' "
                                 f"{proj} input size {k}")
            if k % pack or (n // len(SHARDS[proj])) % pack:
                raise ValueError(f"{self.where}: {self.bits}-bit {self.format_name} packs {pack} values per int32; "
                                 f"the experts' {proj} sizes ({n // len(SHARDS[proj])} outputs per projection, {k} "
                                 f"inputs) must be multiples of {pack}")
            self.groups[proj] = group
            for kind, (shape, dtype) in self.tensor_shapes(n, k, group, len(SHARDS[proj])).items():
                param = nn.Parameter(torch.zeros((experts, *shape), dtype=dtype), requires_grad=False)
                param.weight_loader = self._loader(moe, proj, kind)  # type: ignore[attr-defined]
                param.optional = kind in self.optional  # type: ignore[attr-defined]
                moe.register_parameter(f"{proj}_{kind}", param)
        drop_parameters(moe, "w13_weight", "w2_weight")

    def _loader(self, moe: nn.Module, proj: str, kind: str):
        name = f"{proj}_{kind}"

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
            if (not isinstance(shard_id, tuple) or len(shard_id) != 2 or not isinstance(shard_id[0], int)
                    or shard_id[1] not in SHARDS[proj]):
                raise ValueError(f"{self.where}.{name} takes shard_id (expert_id, one of {SHARDS[proj]}); "
                                 f"got {shard_id!r}")
            expert, shard = shard_id
            if not 0 <= expert < moe.num_experts:
                raise ValueError(f"{self.where}: expert_id {expert} is out of range for {moe.num_experts} experts")
            slot = moe._slot_of.get(expert)
            if slot is None:
                return  # another rank's expert
            index = SHARDS[proj].index(shard)
            target = param.data[slot]
            if kind == "g_idx":
                target = target[index]
            elif proj == "w13":  # w1 | w3 side by side along the output columns (packed or not)
                width = target.shape[-1] // 2
                target = target.narrow(-1, index * width, width)
            if tuple(loaded.shape) != tuple(target.shape):
                raise ValueError(f"{self.where}: experts.{expert}.{shard}.{kind} has shape {tuple(loaded.shape)}, "
                                 f"expected {tuple(target.shape)} (the config declares {self.bits}-bit "
                                 f"{self.format_name}, group_size={self.group_size})")
            target.copy_(loaded)
            param.shard_seen = True  # type: ignore[attr-defined]  # as quant_parameter marks it (gptq.loaded)

        return load

    def process_weights_after_loading(self, moe: nn.Module) -> tuple[list[QuantizedWeight], list[QuantizedWeight]]:
        """Each local expert's (w13, w2) QuantizedWeights; drops the format's parameters."""
        out: dict[str, list[QuantizedWeight]] = {}
        for proj in ("w13", "w2"):
            params = {name.removeprefix(f"{proj}_"): p for name, p in moe.named_parameters(recurse=False)
                      if name.startswith(f"{proj}_")}
            present = {kind: p for kind, p in params.items() if kind not in self.optional or loaded(p)}
            out[proj] = [self.decode({kind: p.data[slot] for kind, p in present.items()}, self.groups[proj],
                                     f"{self.where}.{expert}.{proj}")
                         for slot, expert in enumerate(moe.local_experts)]
            drop_parameters(moe, *(f"{proj}_{kind}" for kind in params))
        return out["w13"], out["w2"]
