"""The sparse feed-forward block of MoE decoders: a router, routed experts, optional shared experts.

    x -> gate (router logits) -> FusedMoE (top-k experts, grouped compute) -> + shared experts(x)

Mixtral has no shared expert; Qwen2-MoE has one, scaled by sigmoid(shared_expert_gate(x));
DeepSeek-V2/V3 add theirs unscaled. How each checkpoint's tensors land on these modules is the
model's `expert_shard` / `checkpoint_name` (models/mixtral.py, qwen_moe.py, deepseek.py).

Tensor parallel (tp > 1): the router and the shared expert gate are replicated; the shared experts
are a tensor-parallel gated MLP. With tensor-parallel routed experts (no expert parallelism) both
the routed output and the shared experts' down projection are partial sums: they are added first
and all-reduced once per block, as the dense MLP's down_proj does. Under expert parallelism the
routed output comes back whole from the all-to-alls and the shared experts reduce their own.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from kvtide.distributed import get_tp_group
from kvtide.layers.linear import ReplicatedLinear
from kvtide.layers.moe import FusedMoE
from kvtide.models.llama import LlamaMLP

EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\."
                           r"(?P<kind>weight|qweight|qzeros|scales|g_idx)$")
"""`layers.3.mlp.experts.7.gate_proj.weight`: one expert's projection in a Hugging Face checkpoint
(or one of its GPTQ tensors, `...gate_proj.qweight`)."""
EXPERT_PARAM = re.compile(r"\.experts\.(?P<proj>w13|w2)_(?:weight|qweight|qzeros|scales|g_idx)$")
"""A stacked FusedMoE parameter: `w13_weight`, or a GPTQ checkpoint's `w13_qweight`, ..."""


def expert_shard(name: str, proj_names: dict[str, str]) -> tuple[str, object] | None:
    """A per-expert checkpoint tensor -> (stacked FusedMoE parameter, (expert, "w1"|"w2"|"w3")).
    `proj_names` maps the checkpoint's projection names onto w1 (gate), w3 (up), w2 (down)."""
    match = EXPERT_TENSOR.match(name)
    if match is None or match["proj"] not in proj_names:
        return None
    shard = proj_names[match["proj"]]
    param = f"{'w2' if shard == 'w2' else 'w13'}_{match['kind']}"
    return f"{match['prefix']}.{param}", (int(match["expert"]), shard)


def required_expert_shards(param_name: str, model: nn.Module) -> set[object] | None:
    """The shard ids that fill a stacked expert parameter of `model` on this rank, or None for any
    other parameter. Under expert parallelism a rank holds (and needs) only its own experts'
    shards, whichever others its loader was also handed."""
    match = EXPERT_PARAM.search(param_name)
    if match is None:
        return None
    shards = ("w1", "w3") if match["proj"] == "w13" else ("w2",)
    experts = model.get_submodule(param_name.rpartition(".")[0])
    assert isinstance(experts, FusedMoE), f"{param_name} does not belong to a FusedMoE"
    return {(e, w) for e in experts.local_experts for w in shards}


class RouterLinear(ReplicatedLinear):
    """The router's hidden -> expert-logit projection. Kept float under weight quantization (its
    logits pick the experts; vLLM leaves it unquantized too); `fp32` computes in float32 as
    DeepSeek's routers do."""

    never_quantize = True

    def __init__(self, hidden_size: int, num_experts: int, fp32: bool = False) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        self.fp32 = fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return F.linear(x.float(), self.weight.float())
        return super().forward(x)


class SharedExpertMLP(LlamaMLP):
    """The shared experts: the gated MLP (tensor parallel like the dense one), which can also
    return its rank's partial product unreduced, for the block to all-reduce with the routed one."""

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial down projection (no all-reduce; shared experts have no bias)."""
        return self.down_proj.matmul(self.act_fn(self.gate_up_proj(x)), None)


class SparseMoeBlock(nn.Module):
    def __init__(self, experts: FusedMoE, hidden_size: int, router_fp32: bool = False,
                 shared_expert: SharedExpertMLP | None = None, shared_expert_gate: bool = False) -> None:
        super().__init__()
        self.gate = RouterLinear(hidden_size, experts.num_experts, fp32=router_fp32)
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = RouterLinear(hidden_size, 1) if shared_expert_gate else None
        self.tp = get_tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))  # a partial sum under tensor-parallel experts
        partial = self.experts.partial_output
        if self.shared_expert is not None:
            shared = self.shared_expert.partial(x) if partial else self.shared_expert(x)
            if self.shared_expert_gate is not None:  # a per-token scale: applies to partial sums alike
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if partial:
            self.tp.all_reduce(out)  # routed and shared experts' partial sums: one all-reduce
        return out
