"""Medusa proposals: k heads on the target's last hidden state, each guessing one token further ahead.

    after every target step   keep, per sampling row, the target's hidden state at the position
                              that predicted the row's last emitted token (the last accepted draft's,
                              or the last known token's when none was accepted)
    proposing k drafts        head i's argmax over that hidden state is draft i + 1: one pass, no
                              KV cache of its own
"""

from __future__ import annotations

import torch

from kvtide.config import EngineConfig
from kvtide.spec_decode.heads.medusa import MedusaHeads
from kvtide.spec_decode.proposer import Proposer, ProposerInput, TargetStep


class MedusaProposer(Proposer):
    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads
        self._last_hidden: dict[str, tuple[int, torch.Tensor]] = {}
        """request id -> (runner uid, the target's hidden state that predicted its last token)."""

    @classmethod
    def from_config(cls, config: EngineConfig, target: torch.nn.Module, device: torch.device) -> MedusaProposer:
        spec, mc = config.speculative_config, config.model_config
        assert spec is not None
        heads = MedusaHeads.from_pretrained(spec.model, mc.hf_config, mc.dtype, device)
        if heads.num_heads < spec.num_speculative_tokens:
            raise ValueError(f"speculative_config: num_speculative_tokens={spec.num_speculative_tokens} but the "
                             f"Medusa checkpoint has only {heads.num_heads} heads")
        return cls(heads)

    def propose(self, batch: ProposerInput) -> dict[str, list[int]]:
        ready = [(state, k) for state, k in batch.rows
                 if self._last_hidden.get(state.request_id, (-1, None))[0] == state.uid]
        if not ready:
            return {}
        hidden = torch.stack([self._last_hidden[state.request_id][1] for state, _ in ready])
        tokens = self.heads(hidden).argmax(dim=-1).tolist()  # (R, heads)
        return {state.request_id: row[:k] for (state, k), row in zip(ready, tokens, strict=True)}

    def observe(self, step: TargetStep) -> None:
        inputs = step.inputs
        first = 0
        hidden_rows = step.hidden[inputs.logits_indices]  # per sampling row: its drafts + 1 positions
        for i in inputs.sample_rows:
            req_id = inputs.order[i]
            tokens = step.emitted.get(req_id, [])
            if tokens:
                self._last_hidden[req_id] = (step.requests[req_id].uid, hidden_rows[first + len(tokens) - 1])
            first += len(step.drafts.get(req_id, ())) + 1

    def forget(self, request_ids: set[str]) -> None:
        for req_id in request_ids:
            self._last_hidden.pop(req_id, None)
