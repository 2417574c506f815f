"""Router scores -> the top-k experts of each token and their weights, as Hugging Face computes them.

Each step (softmax or sigmoid in float32, the group limit, the correction bias, renormalization,
the scaling factor) runs in transformers' own order with its own dtype casts, so the ids and
weights are bit-identical to its routers (tests/layers/test_moe_routing.py builds them and compares).

How each architecture's HF config maps onto `select_experts` (and `FusedMoE`):

  architecture   scoring_func  renormalize      num_expert_group  topk_group  group_score  bias*  routed_scaling_factor
  -------------  ------------  ---------------  ----------------  ----------  -----------  -----  ---------------------
  Mixtral        "softmax"     True             None              None        -            no     1.0
  Qwen2-MoE      "softmax"     norm_topk_prob   None              None        -            no     1.0
  Qwen3-MoE      "softmax"     norm_topk_prob   None              None        -            no     1.0
  DeepSeek-V2    "softmax"     False (**)       n_group (***)     topk_group  "max"        no     routed_scaling_factor
  DeepSeek-V3    "sigmoid"     norm_topk_prob   n_group           topk_group  "top2sum"    yes    routed_scaling_factor

  top_k is num_experts_per_tok everywhere; num_experts is num_local_experts (Mixtral),
  num_experts (Qwen) or n_routed_experts (DeepSeek).
  *    e_score_correction_bias: `gate.e_score_correction_bias` (float32, (E,)), FusedMoE's
       use_score_correction_bias=True.
  **   transformers 5.x's DeepseekV2TopkRouter never renormalizes (it ignores norm_topk_prob;
       the DeepSeek-V2 checkpoints ship norm_topk_prob=false anyway).
  ***  only when topk_method == "group_limited_greedy"; "greedy" is num_expert_group=None.

  Router logits: Mixtral and Qwen compute them in the model dtype (a plain linear); DeepSeek's
  routers cast the hidden states and the gate weight to float32 first. Qwen2/3-MoE also cast the
  top-k weights back to the logits' dtype before they scale the expert outputs: FusedMoE's
  `weights_in_logits_dtype=True` (it matters only in 16-bit models).

Masked groups: DeepSeek-V2 fills the scores of experts outside the kept groups with 0.0 (its weights
are those same scores, all > 0); DeepSeek-V3 chooses by the biased scores, which may be negative, and
fills with -inf. Here: 0.0 without a correction bias, -inf with one. A top_k larger than the kept
groups hold (HF would then pick masked experts) is refused.

Order of the k ids in a row: descending score for plain softmax routing (torch.topk sorted, as
Mixtral/Qwen); with groups, a bias or sigmoid scores the order torch.topk(sorted=False) gives, as
DeepSeek's routers (the order changes nothing downstream but the summation order of the
renormalization, which this keeps identical). DeepSeek-V2 "greedy" is the one case where HF's
order (sorted=False) differs from ours; its (id, weight) pairs are the same.
"""

from __future__ import annotations

import torch

SCORING_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2sum")


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring_func: str = "softmax",
                   renormalize: bool = False, num_expert_group: int | None = None,
                   topk_group: int | None = None, group_score: str = "max",
                   e_score_correction_bias: torch.Tensor | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, E) -> topk_weights (T, top_k) float32, topk_ids (T, top_k) int64.

    scores = softmax or sigmoid of the logits in float32; the experts are chosen by
    scores + e_score_correction_bias (when given), among the topk_group best of num_expert_group
    equal groups (when given; a group's score is its best expert, "max", or the sum of its best
    two, "top2sum"); the weights are the unbiased scores of the chosen experts, divided by their
    sum when `renormalize` (+1e-20 with sigmoid scores, as DeepSeek-V3), times routed_scaling_factor.
    See the module docstring for the HF config fields behind each argument."""
    _check_arguments(router_logits, top_k, scoring_func, num_expert_group, topk_group, group_score,
                     e_score_correction_bias)
    if scoring_func == "softmax":
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (T, E)
    else:
        scores = router_logits.float().sigmoid()
    deepseek_style = (scoring_func == "sigmoid" or num_expert_group is not None
                      or e_score_correction_bias is not None)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None:
        assert topk_group is not None
        fill = 0.0 if e_score_correction_bias is None else float("-inf")
        choice = _mask_unchosen_groups(choice, num_expert_group, topk_group, group_score, fill)
    if e_score_correction_bias is None:
        topk_weights, topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=not deepseek_style)
    else:
        topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        denominator = topk_weights.sum(dim=-1, keepdim=True)
        if scoring_func == "sigmoid":
            denominator = denominator + 1e-20
        topk_weights = topk_weights / denominator
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


def _mask_unchosen_groups(choice: torch.Tensor, num_groups: int, topk_group: int, group_score: str,
                          fill: float) -> torch.Tensor:
    """Scores of the experts outside each token's topk_group best groups set to `fill`.

    E = 8, 4 groups of 2, topk_group 2, "max":  scores [.1 .3 | .2 .0 | .05 .05 | .2 .1]
    -> group scores [.3 .2 .05 .2] -> groups {0, 1} (or {0, 3}: a tie) -> [.1 .3 .2 .0 f f f f]"""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
    if group_score == "max":
        group_scores = grouped.max(dim=-1).values  # (T, num_groups)
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # (T, topk_group)
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups)
                  .reshape(-1, num_experts))
    return choice.masked_fill(~score_mask.bool(), fill)


def _check_arguments(router_logits: torch.Tensor, top_k: int, scoring_func: str,
                     num_expert_group: int | None, topk_group: int | None, group_score: str,
                     bias: torch.Tensor | None) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be (num_tokens, num_experts); got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}]; got {top_k}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}; got {scoring_func!r}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score must be one of {GROUP_SCORES}; got {group_score!r}")
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(f"e_score_correction_bias must be ({num_experts},); got {tuple(bias.shape)}")
    if num_expert_group is None:
        if topk_group is not None:
            raise ValueError("topk_group needs num_expert_group")
        return
    if topk_group is None or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group must be in [1, num_expert_group={num_expert_group}]; got {topk_group}")
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"num_expert_group ({num_expert_group}) must divide the {num_experts} experts")
    per_group = num_experts // num_expert_group
    if group_score == "top2sum" and per_group < 2:
        raise ValueError(f"group_score 'top2sum' needs >= 2 experts per group; got {per_group}")
    if top_k > topk_group * per_group:
        raise ValueError(f"top_k ({top_k}) exceeds the {topk_group * per_group} experts of the kept groups")
