"""Verification of draft tokens: the step that makes speculative decoding exact.

Each emitted token is distributed exactly as if sampled from the target's processed distribution
(Leviathan et al. 2023, Chen et al. 2023): drafts only change how many tokens one target pass yields.

- accept_matching: one-hot drafts (n-gram, heads, greedy drafts). The target samples every position
  itself; the emitted tokens are its samples up to and including the first one that differs from the draft.
- rejection_sample: drafts sampled from a distribution q. Accept d_j when u_j < p_j(d_j) / q_j(d_j); at
  the first rejection emit a draw from the residual max(0, p_j - q_j), after k accepted drafts a bonus draw
  from p_k. Layout: row r verifies k_r <= K drafts, positions 0..k_r of its (K+1)-long target axis.
"""

from __future__ import annotations

import torch


def accept_matching(target_token_ids: list[list[int]], draft_token_ids: list[list[int]]) -> list[list[int]]:
    """Per row, the target's tokens t_0..t_a, a being the first j with draft[j] != t_j (k if none).

    target_token_ids[r] holds len(draft_token_ids[r]) + 1 tokens, each sampled by the target at that position
    given the drafts before it. Returns 1..k+1 tokens per row."""
    if len(target_token_ids) != len(draft_token_ids):
        raise ValueError(f"{len(target_token_ids)} target rows for {len(draft_token_ids)} draft rows")
    out = []
    for targets, drafts in zip(target_token_ids, draft_token_ids, strict=True):
        if len(targets) != len(drafts) + 1:
            raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens, got {len(targets)}")
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        out.append(list(targets[:accepted + 1]))
    return out


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_draft_tokens: list[int], uniforms: torch.Tensor,
                     exponentials: torch.Tensor) -> list[list[int]]:
    """Speculative sampling of stochastic drafts: accepted drafts plus one extra token per row (1..k_r+1).

    target_probs (R, K+1, V): processed target distribution p_j at each verified position.
    draft_probs (R, K, V): distribution q_j each draft was sampled from.
    draft_token_ids (R, K) int64, anything beyond k_r = num_draft_tokens[r].
    uniforms (R, K) in [0, 1): accept d_j when u_j * q_j(d_j) < p_j(d_j).
    exponentials (R, K+1, V) Exp(1) noise: the extra token at position j is argmax(w / exponentials[r, j]),
    w being max(0, p_j - q_j) after a rejection (p_j if that is all zero), p_j after k_r acceptances."""
    num_rows, num_positions, vocab_size = target_probs.shape
    max_drafts = num_positions - 1
    if draft_probs.shape != (num_rows, max_drafts, vocab_size):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)}, expected {(num_rows, max_drafts, vocab_size)}")
    if draft_token_ids.shape != (num_rows, max_drafts) or uniforms.shape != (num_rows, max_drafts):
        raise ValueError(f"draft_token_ids {tuple(draft_token_ids.shape)} and uniforms {tuple(uniforms.shape)}, "
                         f"expected {(num_rows, max_drafts)}")
    if exponentials.shape != target_probs.shape:
        raise ValueError(f"exponentials {tuple(exponentials.shape)}, expected {tuple(target_probs.shape)}")
    if len(num_draft_tokens) != num_rows or any(not 0 <= k <= max_drafts for k in num_draft_tokens):
        raise ValueError(f"num_draft_tokens must hold {num_rows} values in [0, {max_drafts}]: {num_draft_tokens}")
    if num_rows == 0:
        return []
    device = target_probs.device
    rows = torch.arange(num_rows, device=device)
    k = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)

    in_chain = torch.arange(max_drafts, device=device)[None, :] < k[:, None]
    drafts = torch.where(in_chain, draft_token_ids.to(device=device, dtype=torch.int64), 0)
    p_draft = target_probs[:, :max_drafts].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    accepted = (uniforms.to(device) * q_draft < p_draft) & in_chain
    num_accepted = accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # (R,), at most k_r

    # The extra token sits at position num_accepted: a residual draw if a draft was rejected there, else bonus.
    p = target_probs[rows, num_accepted]
    if max_drafts > 0:
        rejected = (num_accepted < k)[:, None]
        q = draft_probs[rows, num_accepted.clamp(max=max_drafts - 1)]
        residual = torch.where(rejected, (p - q).clamp_(min=0), p)
        weights = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    else:
        weights = p
    noise = exponentials[rows, num_accepted].clamp(min=torch.finfo(exponentials.dtype).tiny)
    extra = (weights / noise).argmax(dim=-1)

    tokens = torch.cat((drafts, torch.zeros_like(extra)[:, None]), dim=1)
    tokens.scatter_(1, num_accepted[:, None], extra[:, None])
    packed = torch.cat((num_accepted[:, None], tokens), dim=1).tolist()  # one device sync for the whole batch
    return [row[1:row[0] + 2] for row in packed]


def expected_acceptance_rate(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Probability that a draft sampled from q is accepted against p: sum_v min(p(v), q(v)) over the last dim."""
    return torch.minimum(target_probs, draft_probs).sum(dim=-1)

