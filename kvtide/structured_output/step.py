"""GrammarStep: what the model runner needs of the constrained requests in one step.

The scheduler hands the runner the matchers of the requests that sample this step. The runner
checks their drafts against the grammar before the forward pass (cutting a deterministic draft at
the first token the grammar forbids) and fills their token bitmasks after launching it (on CUDA
the fill overlaps the forward pass). Only the constrained rows are masked: the others pay
nothing.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np
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
        if not indices:
            return
        if logits.device.type == "cpu" and sys.byteorder == "little":
            apply_bitmask_cpu(logits, bitmask, indices)
        else:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            indices=indices)


def apply_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """logits[i, t] = -inf where bit t of bitmask[i] is clear, for i in `indices`: the bits unpacked
    by numpy, turned into an additive 0 / -inf mask in three vector ops and added in place. Five
    times faster than xgrammar 0.2.9's CPU kernel (0.4 vs 2.1 ms for 32 x 32000 on 2 Zen 4 cores),
    which is the largest per-step cost of constrained decoding there."""
    rows = bitmask if len(indices) == bitmask.shape[0] else bitmask[indices]
    bits = np.unpackbits(rows.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :logits.shape[1]]
    # allowed: (1 - 1) * inf = NaN -> 0; forbidden: (0 - 1) * inf = -inf
    add = torch.from_numpy(bits).to(logits.dtype).sub_(1).mul_(math.inf).nan_to_num_(nan=0.0, neginf=-math.inf)
    if len(indices) == logits.shape[0]:
        logits.add_(add)
    else:
        logits.index_add_(0, torch.tensor(indices), add)
