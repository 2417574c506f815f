"""Mixture-of-Experts: routing (routing.py), the grouped expert compute in torch (fused_moe.py), the
`FusedMoE` layer with its stacked weights (layer.py), expert parallelism's placement table
(placement.py) and all-to-all token exchange (expert_parallel.py), and a Triton grouped GEMM for CUDA
(triton_moe.py, imported only when used)."""

from kvtide.layers.moe.fused_moe import apply_capacity, expert_capacity, fused_experts
from kvtide.layers.moe.layer import FusedMoE
from kvtide.layers.moe.placement import ExpertPlacement, all_to_all_bytes, expected_all_to_all_bytes
from kvtide.layers.moe.routing import select_experts

__all__ = ["ExpertPlacement", "FusedMoE", "all_to_all_bytes", "apply_capacity", "expected_all_to_all_bytes",
           "expert_capacity", "fused_experts", "select_experts"]
