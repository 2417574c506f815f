"""GrammarStep: what the model runner needs of the constrained requests in one step.

The scheduler hands the runner the matchers of the requests that sample this step. The runner
checks their drafts against the grammar before the forward pass (cutting a deterministic draft at
the first token the grammar forbids) and fills their token bitmasks after launching it (on CUDA
the fill overlaps the forward pass). Only the constrained rows are masked: the others pay
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GrammarStep:
    grammars: dict
    """request id -> RequestGrammar, for the constrained requests sampling this step."""
    vocab_size: int
    _draft_masks: dict[str, torch.Tensor] = field(default_factory=dict)

    def check_drafts(self, drafts: dict[str, list[int]], keep: set[str]) -> dict[str, list[int]]:
        """Drafts cut before the first token the grammar forbids (the rest could never be
        accepted), except for the requests in `keep`: drafts sampled from a draft model's
        distribution stay whole so rejection sampling stays exact (the mask gives a forbidden
        draft zero target probability). Fills those requests' masks on the way."""
        import xgrammar as xgr

        checked = dict(drafts)
        for req_id, tokens in drafts.items():
            grammar = self.grammars.get(req_id)
            if grammar is None:
                continue
            masks = xgr.allocate_token_bitmask(len(tokens) + 1, self.vocab_size)
            num_ok = grammar.check_drafts(tokens, masks, 0)
            if req_id not in keep and num_ok < len(tokens):
                checked[req_id] = tokens[:num_ok]
                masks = masks[:num_ok + 1]
            self._draft_masks[req_id] = masks
        return {req_id: tokens for req_id, tokens in checked.items() if tokens}

    def apply(self, logits: torch.Tensor, row_layout: list[tuple[str, int]]) -> None:
        """Mask `logits` in place. row_layout: per sampling request in logits order, its id and
        the number of logits rows it has (its drafts + 1)."""
        import xgrammar as xgr

        bitmask = None
        indices: list[int] = []
        row = 0
        for req_id, num_rows in row_layout:
            grammar = self.grammars.get(req_id)
            if grammar is not None:
                if bitmask is None:
                    bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
                masks = self._draft_masks.get(req_id)
                if masks is not None and masks.shape[0] == num_rows:
                    bitmask[row:row + num_rows] = masks
                    indices.extend(range(row, row + num_rows))
                elif grammar.fill_bitmask(bitmask, row):
                    indices.append(row)
            row += num_rows
        if indices:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            indices=indices)
