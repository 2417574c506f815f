"""Speculative decoding on a replica of several ranks: every rank agrees on a step's drafts and on
what its verification emitted.

Every rank runs the same step on the same SchedulerOutput, and each keeps its own copy of the
requests' tokens (worker/model_runner.py). Speculation adds two points where copies could part:

    propose   the drafts decide the step's shapes (tokens per request) on every rank, and are the
              first stage's inputs. An n-gram proposal is a function of the request's tokens and a
              draft model's or a head's (sharded over the TP group, so its logits are all-gathered)
              is the same on every rank; but under tensor parallelism alone only the rank beside
              the engine core cuts drafts by the grammar (under pipeline parallelism every rank
              takes the cut computed ahead in the engine core: structured_output/step.py).
              TP rank 0's drafts are therefore broadcast over the TP group (one int64 per draft slot).
    verify    every rank of the sampling stage holds the same logits and verifies; the accepted
              run decides num_computed_tokens' rollback, which the scheduler takes from the output
              rank (the last stage's TP rank 0). That rank's emitted tokens are broadcast over the TP
              group (one int64 per position that may emit), so every rank's tokens, a draft model's
              KV bookkeeping and an EAGLE head's pairs follow the same accepted run.

The proposers under tensor parallelism:

    ngram        no model: a function of the request's tokens, which every rank holds alike.
    draft_model  sharded over the target's TP group (vLLM's default): load_model builds it from the
                 same parallel layers, so each rank holds 1/tp of its weights and of its KV heads.
                 Replicating it instead would cost every rank the draft's whole KV cache per block
                 (the block count is shared) and its whole weights, for no saved communication: the
                 chain steps run on every rank anyway, in the same shapes (one all-reduce per
                 attention and MLP, an all-gather of the logits), so they stay in lockstep.
    layer_skip   the target's own first layers and LM head, sharded as the target is.
    medusa       replicated residual blocks and vocabulary-parallel LM heads over the target's hidden
                 states, which are whole on every rank after the last all-reduce.
    eagle(3)     the head's decoder layer(s) sharded over the TP group like the draft model
                 (QKV/column/row-parallel, its own table and LM head vocabulary-parallel, EAGLE-3's
                 draft-to-target map whole), its fc replicated; it reads the target's hidden states
                 (EAGLE-3: three residual-stream states), whole on every rank, and its logits are
                 all-gathered, so every rank's chain steps run in lockstep on the same drafts.

Under pipeline parallelism only n-gram drafts run: a draft model, the early-exit layers or a head
would have to produce the drafts where the first stage needs them as inputs, from weights or hidden
states that live on other stages.

Earlier pipeline stages learn the emitted tokens (accepted drafts, then the sampled token) with the
request's next step (CachedRequestData.sampled_token_ids, from the executor's SampledTokenRelay),
and propose n-gram drafts from them alike. With one rank per stage both calls are no-ops.

    slots {a: 3, b: 2}, drafts {a: [7, 9], b: [4, 4]}  ->  sent [7, 9, -1, 4, 4]  (sorted by id)
"""

from __future__ import annotations

import torch

from kvtide.distributed import get_tp_group

PAD = -1
"""An empty slot: a draft slot the proposer left empty, or a position that emitted nothing."""


def broadcast_drafts(num_draft_slots: dict[str, int], drafts: dict[str, list[int]],
                     device: torch.device) -> dict[str, list[int]]:
    """TP rank 0's drafts on every rank of its TP group. `num_draft_slots` (the scheduler's
    num_draft_tokens) is the same on every rank, so the message's size is known to all."""
    if get_tp_group().world_size == 1 or not num_draft_slots:
        return drafts
    order = sorted(num_draft_slots)
    agreed = _broadcast_runs(order, [num_draft_slots[r] for r in order], drafts, device)
    return {req_id: run for req_id, run in agreed.items() if run}


def broadcast_emitted(order: list[str], drafts: dict[str, list[int]], emitted: dict[str, list[int]],
                      device: torch.device) -> dict[str, list[int]]:
    """TP rank 0's emitted tokens per sampling request (`order`: the same on every rank; at most
    len(drafts) + 1 each, [] for a failed row) on every rank of its TP group."""
    if get_tp_group().world_size == 1 or not order:
        return emitted
    return _broadcast_runs(order, [len(drafts.get(r, ())) + 1 for r in order], emitted, device)


def _broadcast_runs(order: list[str], sizes: list[int], runs: dict[str, list[int]],
                    device: torch.device) -> dict[str, list[int]]:
    """Per request of `order` a run of at most `sizes[i]` token ids, padded and sent as one tensor
    from TP rank 0; returns the runs every rank now holds."""
    flat = [PAD] * sum(sizes)
    offset = 0
    for req_id, size in zip(order, sizes, strict=True):
        run = runs.get(req_id, [])
        assert len(run) <= size, f"request {req_id}: {len(run)} tokens for {size} slots"
        flat[offset:offset + len(run)] = run
        offset += size
    message = torch.tensor(flat, dtype=torch.int64, device=device)  # (sum(sizes),)
    get_tp_group().broadcast(message, 0)
    values = message.tolist()
    agreed: dict[str, list[int]] = {}
    offset = 0
    for req_id, size in zip(order, sizes, strict=True):
        agreed[req_id] = [t for t in values[offset:offset + size] if t != PAD]
        offset += size
    return agreed
