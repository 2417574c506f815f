"""Tensor-parallel experts (FusedMoE under tp > 1 without expert parallelism), in one process: each
"rank" is a FusedMoE built under a stand-in TP group of 2. Each holds every expert's 1/tp slice of
the intermediate dimension (w13's gate and up halves sliced separately, w2's columns), loaded from
per-expert tensors or whole stacked ones (lazily read safetensors slices), and the ranks' partial
outputs sum to the world-size-1 layer's output. The multi-process runs are in
tests/models/test_parallel_parity.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvtide.layers.moe import FusedMoE
from kvtide.layers.moe import layer as moe_layer
from kvtide.models.lazy_tensor import LazyTensor

E, K, H, INTER = 4, 2, 16, 12  # experts, top-k, hidden, intermediate
TP = 2


@dataclasses.dataclass
class StandInGroup:
    world_size: int
    rank_in_group: int


def build(monkeypatch, rank: int | None) -> FusedMoE:
    """The layer at world size 1 (rank None) or as TP rank `rank` of TP."""
    if rank is not None:
        monkeypatch.setattr(moe_layer, "get_tp_group", lambda: StandInGroup(TP, rank))
    try:
        return FusedMoE(E, K, H, INTER, renormalize=True)
    finally:
        monkeypatch.undo()


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w13": torch.randn(E, 2 * INTER, H, generator=gen), "w2": torch.randn(E, H, INTER, generator=gen) / INTER ** 0.5}


def load_per_expert(layer: FusedMoE, w: dict[str, torch.Tensor]) -> None:
    for e in range(E):
        layer.w13_weight.weight_loader(layer.w13_weight, w["w13"][e, :INTER], (e, "w1"))
        layer.w13_weight.weight_loader(layer.w13_weight, w["w13"][e, INTER:], (e, "w3"))
        layer.w2_weight.weight_loader(layer.w2_weight, w["w2"][e], (e, "w2"))


def test_ranks_hold_a_slice_and_their_partial_outputs_sum_to_the_whole(monkeypatch, weights):
    whole = build(monkeypatch, None)
    load_per_expert(whole, weights)
    assert not whole.partial_output
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(9, E, generator=torch.Generator().manual_seed(2))
    expected = whole(x, logits)
    total = torch.zeros_like(expected)
    for rank in range(TP):
        layer = build(monkeypatch, rank)
        load_per_expert(layer, weights)
        inter = INTER // TP
        rows = slice(rank * inter, (rank + 1) * inter)
        assert layer.partial_output and layer.local_intermediate_size == inter
        assert layer.w13_weight.shape == (E, 2 * inter, H) and layer.w2_weight.shape == (E, H, inter)
        assert torch.equal(layer.w13_weight[:, :inter], weights["w13"][:, :INTER][:, rows])  # gate rows
        assert torch.equal(layer.w13_weight[:, inter:], weights["w13"][:, INTER:][:, rows])  # up rows
        assert torch.equal(layer.w2_weight, weights["w2"][:, :, rows])
        assert layer.w13_weight.nbytes * TP == whole.w13_weight.nbytes
        partial = layer(x, logits)
        assert not torch.allclose(partial, expected, atol=1e-3)  # a partial sum, not the output
        total += partial
        assert torch.equal(layer.expert_tokens, whole.expert_tokens)  # routing and counts: global
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_whole_stacked_lazy_tensors_read_only_the_rank_slice(monkeypatch, weights, tmp_path):
    path = str(tmp_path / "experts.safetensors")
    save_file({"w13": weights["w13"], "w2": weights["w2"]}, path)
    for rank in range(TP):
        per_expert = build(monkeypatch, rank)
        load_per_expert(per_expert, weights)
        stacked = build(monkeypatch, rank)
        with safe_open(path, framework="pt") as f:
            for name, param in (("w13", stacked.w13_weight), ("w2", stacked.w2_weight)):
                param.weight_loader(param, LazyTensor(f.get_slice(name)), None)
        assert torch.equal(stacked.w13_weight, per_expert.w13_weight)
        assert torch.equal(stacked.w2_weight, per_expert.w2_weight)
    with pytest.raises(ValueError, match="weight shape mismatch"):
        stacked.w2_weight.weight_loader(stacked.w2_weight, weights["w2"][:, :, :-1], None)


def test_indivisible_intermediate_size_and_quantization_are_refused(monkeypatch):
    monkeypatch.setattr(moe_layer, "get_tp_group", lambda: StandInGroup(TP, 0))
    with pytest.raises(ValueError, match=r"intermediate size \(13\) is not divisible by tensor_parallel_size=2"):
        FusedMoE(E, K, H, 13)
    layer = FusedMoE(E, K, H, INTER)
    with pytest.raises(NotImplementedError, match="--enable-expert-parallel"):
        layer.quantize_experts(lambda w: w)


def test_engine_config_refuses_quantized_tensor_parallel_experts(checkpoint_factory):
    """Quantized experts run whole (expert parallel) or at world size 1, not split by columns."""
    from kvtide.engine_args import EngineArgs

    mixtral = checkpoint_factory("MixtralForCausalLM")
    with pytest.raises(ValueError, match="experts split over tensor-parallel ranks is not supported"):
        EngineArgs(model=mixtral, tensor_parallel_size=2, cpu_threads_per_rank=1,
                   quantization="int8").create_engine_config(mixtral)
    config = EngineArgs(model=mixtral, tensor_parallel_size=2, cpu_threads_per_rank=1).create_engine_config(mixtral)
    assert not config.parallel_config.enable_expert_parallel  # tensor-parallel experts are accepted
