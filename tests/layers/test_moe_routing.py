"""select_experts and FusedMoE against transformers' own MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2, DeepSeek-V3), built from tiny configs with seeded random weights: the routing (ids and
weights) is bit-identical to HF's router given the same logits, and the whole block (router linear
+ FusedMoE loaded per expert through its weight_loader + shared experts as the models add them)
equals HF's block output. The configs follow routing.py's table; the group-limited cases keep
fewer groups than exist and DeepSeek-V3 has a nonzero correction bias, so both change the choice."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import transformers.models.deepseek_v2.modeling_deepseek_v2 as hf_deepseek_v2
import transformers.models.deepseek_v3.modeling_deepseek_v3 as hf_deepseek_v3
import transformers.models.mixtral.modeling_mixtral as hf_mixtral
import transformers.models.qwen2_moe.modeling_qwen2_moe as hf_qwen2_moe
import transformers.models.qwen3_moe.modeling_qwen3_moe as hf_qwen3_moe
from torch import nn
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from kvtide.layers.moe import FusedMoE, select_experts
from kvtide.layers.moe.routing import _mask_unchosen_groups

HIDDEN, INTERMEDIATE, NUM_TOKENS = 32, 16, 40
COMMON = dict(hidden_size=HIDDEN, hidden_act="silu", experts_implementation="eager")


@dataclasses.dataclass
class Case:
    """One HF MoE block and the FusedMoE arguments routing.py's table gives for its config."""
    block: nn.Module
    moe_kwargs: dict
    num_experts: int
    top_k: int
    router: Callable[[torch.Tensor], torch.Tensor]  # the model's router linear: hidden -> logits
    shared: Callable[[torch.Tensor], torch.Tensor] | None  # the model's shared experts, if any
    unsorted_in_hf: bool = False  # HF's torch.topk(sorted=False) where ours sorts (DeepSeek-V2 greedy)


def _seed_weights(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters()):
        scale = 1.0 if name.startswith("gate.") else p.shape[-1] ** -0.5
        p.data.copy_(torch.randn(p.shape, generator=g) * scale)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):  # nonzero, of the scores' size: it changes picks
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)


def _make(name: str) -> Case:
    if name == "mixtral":
        config = MixtralConfig(intermediate_size=INTERMEDIATE, num_local_experts=8, num_experts_per_tok=2, **COMMON)
        block = hf_mixtral.MixtralSparseMoeBlock(config)
        kwargs, shared = dict(renormalize=True), None
    elif name.startswith(("qwen2", "qwen3")):
        norm = name.endswith("norm")
        if name.startswith("qwen2"):
            config = Qwen2MoeConfig(moe_intermediate_size=INTERMEDIATE, shared_expert_intermediate_size=24,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm, **COMMON)
            block = hf_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
            shared = lambda x: block.shared_expert(x) * torch.sigmoid(block.shared_expert_gate(x))  # noqa: E731
        else:
            config = Qwen3MoeConfig(moe_intermediate_size=INTERMEDIATE, num_experts=16, num_experts_per_tok=4,
                                    norm_topk_prob=norm, **COMMON)
            block, shared = hf_qwen3_moe.Qwen3MoeSparseMoeBlock(config), None
        kwargs = dict(renormalize=config.norm_topk_prob, weights_in_logits_dtype=True)
    elif name.startswith("deepseek_v2"):
        grouped = name.endswith("grouped")
        config = DeepseekV2Config(moe_intermediate_size=INTERMEDIATE, n_routed_experts=16, num_experts_per_tok=3,
                                  n_shared_experts=2, routed_scaling_factor=1.5, n_group=4, topk_group=2,
                                  topk_method="group_limited_greedy" if grouped else "greedy", **COMMON)
        block = hf_deepseek_v2.DeepseekV2Moe(config)
        kwargs = dict(renormalize=False, routed_scaling_factor=config.routed_scaling_factor)
        if grouped:
            kwargs |= dict(num_expert_group=config.n_group, topk_group=config.topk_group, group_score="max")
        shared = block.shared_experts
    else:  # deepseek_v3[_nonorm|_onegroup]
        config = DeepseekV3Config(moe_intermediate_size=INTERMEDIATE, n_routed_experts=16, num_experts_per_tok=4,
                                  n_shared_experts=1, routed_scaling_factor=2.5,
                                  n_group=1 if name.endswith("onegroup") else 4, topk_group=1 if
                                  name.endswith("onegroup") else 2, norm_topk_prob=not name.endswith("nonorm"),
                                  **COMMON)
        block = hf_deepseek_v3.DeepseekV3MoE(config)
        kwargs = dict(scoring_func="sigmoid", renormalize=config.norm_topk_prob, num_expert_group=config.n_group,
                      topk_group=config.topk_group, group_score="top2sum", use_score_correction_bias=True,
                      routed_scaling_factor=config.routed_scaling_factor)
        shared = block.shared_experts
    _seed_weights(block, seed=len(name))
    gate = block.gate
    if name.startswith("deepseek"):  # DeepSeek's routers: float32 logits whatever the model dtype
        router = lambda x: F.linear(x.float(), gate.weight.float())  # noqa: E731
    else:
        router = lambda x: F.linear(x, gate.weight)  # noqa: E731
    return Case(block.eval(), kwargs, gate.num_experts, gate.top_k, router, shared,
                unsorted_in_hf=name == "deepseek_v2")


ARCHITECTURES = ["mixtral", "qwen2", "qwen2_norm", "qwen3", "qwen3_norm", "deepseek_v2", "deepseek_v2_grouped",
                 "deepseek_v3", "deepseek_v3_nonorm", "deepseek_v3_onegroup"]


def _routing_kwargs(case: Case) -> dict:
    kwargs = {k: v for k, v in case.moe_kwargs.items() if k not in ("use_score_correction_bias",
                                                                     "weights_in_logits_dtype")}
    if case.moe_kwargs.get("use_score_correction_bias"):
        kwargs["e_score_correction_bias"] = case.block.gate.e_score_correction_bias
    return kwargs


def _hidden(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _load_fused_moe(case: Case) -> FusedMoE:
    experts = case.block.experts
    moe = FusedMoE(case.num_experts, case.top_k, HIDDEN, INTERMEDIATE, **case.moe_kwargs)
    for e in range(case.num_experts):  # the per-expert tensors a checkpoint holds
        gate_proj, up_proj = experts.gate_up_proj[e].detach().chunk(2, dim=0)
        moe.w13_weight.weight_loader(moe.w13_weight, gate_proj.clone(), (e, "w1"))
        moe.w13_weight.weight_loader(moe.w13_weight, up_proj.clone(), (e, "w3"))
        moe.w2_weight.weight_loader(moe.w2_weight, experts.down_proj[e].detach().clone(), (e, "w2"))
    if moe.e_score_correction_bias is not None:
        bias = case.block.gate.e_score_correction_bias
        moe.e_score_correction_bias.weight_loader(moe.e_score_correction_bias, bias, None)
    return moe


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_routing_is_bit_identical_to_hf(name):
    case = _make(name)
    x = _hidden(seed=1)
    with torch.no_grad():
        hf_logits, hf_weights, hf_ids = case.block.gate(x)
    weights, ids = select_experts(hf_logits, case.top_k, **_routing_kwargs(case))
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (NUM_TOKENS, case.top_k)
    if case.unsorted_in_hf:  # same (id, weight) pairs, HF's rows in torch.topk(sorted=False) order
        hf_ids, perm = hf_ids.sort(dim=-1)
        hf_weights = hf_weights.gather(1, perm)
        ids, perm = ids.sort(dim=-1)
        weights = weights.gather(1, perm)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights.float())


@pytest.mark.parametrize("name", ["deepseek_v2_grouped", "deepseek_v3"])
def test_the_group_limit_and_the_bias_change_the_choice(name):
    """Without them these cases would pick other experts: the comparison above tests both."""
    case = _make(name)
    with torch.no_grad():
        logits = case.router(_hidden(seed=1))
    kwargs = _routing_kwargs(case)
    _, ids = select_experts(logits, case.top_k, **kwargs)
    ungrouped = {k: v for k, v in kwargs.items() if k not in ("num_expert_group", "topk_group")}
    assert not torch.equal(ids.sort(-1)[0], select_experts(logits, case.top_k, **ungrouped)[1].sort(-1)[0])
    if "e_score_correction_bias" in kwargs:
        unbiased = dict(kwargs, e_score_correction_bias=None)
        assert not torch.equal(ids.sort(-1)[0], select_experts(logits, case.top_k, **unbiased)[1].sort(-1)[0])
        # every pick lies in the topk_group groups kept
        groups = ids // (case.num_experts // kwargs["num_expert_group"])
        assert max(len(set(row)) for row in groups.tolist()) <= kwargs["topk_group"]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_block_output_equals_hf(name):
    case = _make(name)
    moe = _load_fused_moe(case)
    x = _hidden(seed=2)
    with torch.no_grad():
        expected = case.block(x.unsqueeze(0)).squeeze(0)
        actual = moe(x, case.router(x))
        if case.shared is not None:
            actual = actual + case.shared(x)
    scale = expected.abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * scale)
    assert int(moe.expert_tokens.sum()) == NUM_TOKENS * case.top_k


@pytest.mark.parametrize("name", ["mixtral", "qwen2_norm", "qwen3"])
def test_bf16_block_output_is_bit_identical_to_hf(name):
    """In bf16 the casts matter: Mixtral scales by float32 weights, Qwen by weights rounded to bf16
    (weights_in_logits_dtype); the expert outputs accumulate in bf16 expert by expert."""
    case = _make(name)
    case.block.to(torch.bfloat16)
    moe = _load_fused_moe(case).to(torch.bfloat16)
    x = _hidden(seed=3, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = case.block(x.unsqueeze(0)).squeeze(0)
        actual = moe(x, case.router(x))
        if case.shared is not None:
            actual = actual + case.shared(x)
    assert actual.dtype == torch.bfloat16
    # bit for bit: the other weight cast, or summing a token's k rows in one index_add_ (float32
    # accumulation), is off by a bf16 ulp in places
    assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()


def test_masked_groups_as_the_docstring_example():
    scores = torch.tensor([[.1, .3, .2, .0, .05, .05, .2, .1]])
    masked = _mask_unchosen_groups(scores, num_groups=4, topk_group=2, group_score="max", fill=-1.0)
    kept = (masked[0] != -1.0).view(4, 2).all(dim=1).tolist()
    assert kept[0] and not kept[2] and sum(kept) == 2 and (kept[1] or kept[3])
    masked = _mask_unchosen_groups(scores, num_groups=4, topk_group=2, group_score="top2sum", fill=-1.0)
    assert (masked[0] != -1.0).view(4, 2).all(dim=1).tolist() == [True, False, False, True]  # .4 .2 .1 .3


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=9), "top_k"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(num_expert_group=3, topk_group=1), "divide"),
    (dict(num_expert_group=4, topk_group=5), "topk_group"),
    (dict(topk_group=2), "needs num_expert_group"),
    (dict(num_expert_group=8, topk_group=1, group_score="top2sum"), ">= 2 experts per group"),
    (dict(num_expert_group=4, topk_group=1, top_k=3), "exceeds"),
    (dict(e_score_correction_bias=torch.zeros(7)), r"\(8,\)"),
])
def test_bad_arguments_raise(kwargs, match):
    kwargs = {"top_k": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        select_experts(torch.randn(3, 8), **kwargs)
