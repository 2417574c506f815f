"""GrammarStep: what the model runner needs of the constrained requests in one step.

The scheduler hands the runner the matchers of the requests that sample this step. The runner
checks their drafts against the grammar before the forward pass (cutting a deterministic draft at
the first token the grammar forbids) and fills their token bitmasks after launching it (on CUDA
the fill overlaps the forward pass). Only the constrained rows are masked: the others pay
nothing.

Under pipeline parallelism the last stage samples in another process, away from the matchers:
there the engine core computes the step ahead (`GrammarStep.ahead`: the same draft check and
masks, before the step) and the result, a StepBitmask, travels with the scheduler output.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtide.structured_output.grammar import RequestGrammar


@dataclass
class GrammarStep:
    grammars: dict[str, RequestGrammar]
    """request id -> its matcher, for the constrained requests sampling this step."""
    vocab_size: int
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    """request id -> its tokens as the scheduler holds them (what the runner will hold this step):
    for proposing a constrained request's drafts ahead of the step (`ahead`)."""
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
            apply_bitmask(logits, bitmask, indices)

    def ahead(self, num_draft_tokens: dict[str, int],
              propose: Callable[[list[int], int], list[int]] | None) -> StepBitmask:
        """This step's draft cut and masks computed now, for a rank without the matchers: each
        constrained request's drafts (`propose(its tokens, its draft slots)`, the proposer every rank
        runs) tried on its matcher and cut as `check_drafts` cuts them, then its rows filled as
        `apply` fills them. Deterministic drafts only (none is kept whole)."""
        import xgrammar as xgr

        drafts: dict[str, list[int]] = {}
        masks: dict[str, torch.Tensor] = {}
        for req_id, grammar in self.grammars.items():
            k = num_draft_tokens.get(req_id, 0)
            tokens = propose(self.token_ids[req_id], k) if k and propose is not None else []
            if tokens:
                rows = xgr.allocate_token_bitmask(len(tokens) + 1, self.vocab_size)
                num_ok = grammar.check_drafts(tokens, rows, 0)
                drafts[req_id], masks[req_id] = tokens[:num_ok], rows[:num_ok + 1]
                continue
            drafts[req_id] = []
            row = xgr.allocate_token_bitmask(1, self.vocab_size)
            if grammar.fill_bitmask(row, 0):
                masks[req_id] = row
        return StepBitmask(drafts, masks)


@dataclass
class StepBitmask:
    """A GrammarStep computed ahead in the engine core (`GrammarStep.ahead`), for the ranks of a
    pipeline: the same interface to the runner, and plain bytes on the wire."""

    drafts: dict[str, list[int]]
    """Every constrained request sampling this step -> its drafts after the grammar's cut."""
    masks: dict[str, torch.Tensor]
    """request id -> its bitmask rows, one per token it may emit; absent: nothing to mask."""

    def check_drafts(self, drafts: dict[str, list[int]], keep: set[str]) -> dict[str, list[int]]:
        """The constrained requests' drafts as the engine core cut them (every rank proposed the
        same ones from the same tokens); the others' as proposed."""
        checked = {req_id: tokens for req_id, tokens in drafts.items() if req_id not in self.drafts}
        checked.update((req_id, tokens) for req_id, tokens in self.drafts.items() if tokens)
        return checked

    def apply(self, logits: torch.Tensor, row_layout: list[tuple[str, int]]) -> None:
        """As GrammarStep.apply, from the rows computed ahead."""
        if not self.masks:
            return
        bitmask = None
        indices: list[int] = []
        row = 0
        for req_id, num_rows in row_layout:
            masks = self.masks.get(req_id)
            if masks is not None:
                if masks.shape[0] != num_rows:
                    raise RuntimeError(f"request {req_id}: {masks.shape[0]} grammar mask rows computed ahead "
                                       f"for {num_rows} logits rows")
                if bitmask is None:
                    bitmask = torch.full((logits.shape[0], masks.shape[1]), -1, dtype=torch.int32)
                bitmask[row:row + num_rows] = masks
                indices.extend(range(row, row + num_rows))
            row += num_rows
        if indices:
            apply_bitmask(logits, bitmask, indices)

    def to_wire(self) -> dict:
        return {"drafts": self.drafts,
                "masks": {req_id: [m.shape[0], m.numpy().tobytes()] for req_id, m in self.masks.items()}}

    @classmethod
    def from_wire(cls, wire: dict) -> StepBitmask:
        masks = {req_id: torch.from_numpy(np.frombuffer(data, dtype=np.int32).reshape(rows, -1).copy())
                 for req_id, (rows, data) in wire["masks"].items()}
        return cls({req_id: list(tokens) for req_id, tokens in wire["drafts"].items()}, masks)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """Mask rows `indices` of `logits` in place by `bitmask` (one row per logits row)."""
    if logits.device.type == "cpu" and sys.byteorder == "little":
        apply_bitmask_cpu(logits, bitmask, indices)
    else:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=indices)


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
