"""EAGLE / EAGLE-3 proposals: a one-layer head over the target's features, with a paged KV cache.

The head's position i holds the pair (feature_i, token_{i+1}), feature_i being the target's hidden
state at i (EAGLE-3: three of its layers' inputs, fused by the head's fc). Its output at i is its
guess of feature_{i+1}, whose logits propose token_{i+2}.

    after every target step   the head computes the pairs of every position the target verified in
                              it (prefill chunks included), in one packed pass; its output at a row's
                              last known position is kept
    proposing k drafts        d1 from the kept output g; then (g, d1) at the next position gives
                              g' and d2, and so on: k-1 single-token steps

So the head's KV is written for every position in the same step as the target's: prefix-cache hits,
preemption and copy-on-write need nothing of their own, and chain steps write only slots the
target allocated for its verification (rewritten with the verified pairs after it).
"""

from __future__ import annotations

import torch

from kvtide.config import EngineConfig
from kvtide.sampling.ops import argmax_first
from kvtide.spec_decode.draft_proposer import DraftSequence
from kvtide.spec_decode.heads.eagle import EagleDraftModel
from kvtide.spec_decode.proposer import Proposer, ProposerInput, TargetStep
from kvtide.worker.input_batch import prepare_step_inputs


class EagleProposer(Proposer):
    """EAGLE-1 or EAGLE-3 (the head's method), proposing argmax drafts."""

    def __init__(self, head: torch.nn.Module, target: torch.nn.Module, block_size: int,
                 device: torch.device) -> None:
        self.head = head
        self.target = target
        self.block_size = block_size
        self.device = device
        if head.method == "eagle3":
            target.aux_hidden_state_layers = head.aux_layer_ids(target.config)
        self._last: dict[str, tuple[int, torch.Tensor]] = {}
        """request id -> (runner uid, the head's output at its last known position)."""

    @classmethod
    def from_config(cls, config: EngineConfig, target: torch.nn.Module, device: torch.device) -> EagleProposer:
        spec, mc = config.speculative_config, config.model_config
        assert spec is not None
        head = EagleDraftModel.from_pretrained(spec.model, spec.method, target, mc.hf_config, mc.max_model_len,
                                               mc.dtype, device)
        return cls(head, target, config.cache_config.block_size, device)

    def attention_layers(self) -> list:
        return self.head.attention_layers()

    def observe(self, step: TargetStep) -> None:
        """After a target step: the head's pairs for the positions each row verified (its tokens up
        to the last accepted one; the state's token ids already end with the step's new token)."""
        inputs, requests = step.inputs, step.requests
        features = torch.cat(self.target.aux_hidden_states, dim=-1) if self.head.method == "eagle3" else step.hidden
        qsl = inputs.metadata.query_start_loc_cpu
        seqs: dict[str, DraftSequence] = {}
        num_sched: dict[str, int] = {}
        first_token: dict[str, int] = {}
        for i, req_id in enumerate(inputs.order):
            # the row's tokens before its drafts are known; of a sampling row's drafts, the accepted
            # ones (its last emitted token is not computed yet); a failed row verified nothing
            known = qsl[i + 1] - qsl[i] - len(step.drafts.get(req_id, ()))
            emitted = step.emitted.get(req_id)
            n = known if emitted is None else (known + len(emitted) - 1 if emitted else 0)
            if n <= 0:
                continue
            state = requests[req_id]
            # shifted by one: the token at index i of this list is token_{i+1}, paired with feature_i
            seqs[req_id] = DraftSequence(state.token_ids[1:], state.num_computed_tokens, state.block_ids, state.uid)
            num_sched[req_id] = n
            first_token[req_id] = qsl[i]
        if not seqs:
            return
        head_inputs = prepare_step_inputs(num_sched, seqs, self.block_size, self.device)
        index = torch.tensor([j for req_id in head_inputs.order
                              for j in range(first_token[req_id], first_token[req_id] + num_sched[req_id])],
                             dtype=torch.int64, device=features.device)
        combined = self.head.combine_features(features[index])
        out = self.head(head_inputs.input_ids, combined, head_inputs.positions, head_inputs.metadata)
        last = out[head_inputs.logits_indices]
        for row, feature in zip(head_inputs.sample_rows, last, strict=True):
            req_id = head_inputs.order[row]
            self._last[req_id] = (seqs[req_id].uid, feature)

    def propose(self, batch: ProposerInput) -> dict[str, list[int]]:
        ready = [(state, k) for state, k in batch.rows if self._last.get(state.request_id, (-1, None))[0] == state.uid]
        if not ready:
            return {}
        features = torch.stack([self._last[state.request_id][1] for state, _ in ready])
        drafts: dict[str, list[int]] = {state.request_id: [] for state, _ in ready}
        seqs = {state.request_id: DraftSequence(state.token_ids[1:], state.num_computed_tokens, state.block_ids,
                                                 state.uid) for state, _ in ready}
        active = ready
        while True:
            tokens = argmax_first(self.head.compute_logits(features)).tolist()
            for (state, _), token in zip(active, tokens, strict=True):
                drafts[state.request_id].append(token)
                seqs[state.request_id].token_ids.append(token)
            keep = [i for i, (state, k) in enumerate(active) if len(drafts[state.request_id]) < k]
            if not keep:
                return drafts
            active = [active[i] for i in keep]
            features = features[keep]
            num_sched = {state.request_id: 1 for state, _ in active}
            step = prepare_step_inputs(num_sched, {r: seqs[r] for r in num_sched}, self.block_size, self.device)
            by_row = {state.request_id: i for i, (state, _) in enumerate(active)}
            order = torch.tensor([by_row[r] for r in step.order], dtype=torch.int64, device=features.device)
            out = self.head(step.input_ids, features[order], step.positions, step.metadata)
            features = out[torch.argsort(order)]
            for state, _ in active:
                seqs[state.request_id].num_computed_tokens += 1

    def forget(self, request_ids: set[str]) -> None:
        for req_id in request_ids:
            self._last.pop(req_id, None)
