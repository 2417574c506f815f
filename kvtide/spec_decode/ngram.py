"""N-gram (prompt lookup) proposals: no model, the request's own tokens are the draft.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens are searched for among
the earlier ones; at the latest earlier occurrence of the longest n that occurs, the tokens that
followed it are the draft. Text that copies from its input (rewrites, summaries, code edits)
is where this pays:

    tokens:  ... the cat sat on the mat . the cat | ?     suffix "the cat" (n=2) seen at 0
    draft:   "sat on the"                                  (what followed it, up to k tokens)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from kvtide.config import EngineConfig
from kvtide.spec_decode.proposer import Proposer, ProposerInput


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    @classmethod
    def from_config(cls, config: EngineConfig, target: torch.nn.Module, device: torch.device) -> NgramProposer:
        spec = config.speculative_config
        assert spec is not None
        return cls(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, batch: ProposerInput) -> dict[str, list[int]]:
        return {request.request_id: self.propose_one(request.token_ids, k) for request, k in batch.rows}

    def propose_one(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Up to k draft tokens continuing `token_ids`; [] when no suffix n-gram recurs."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows over tokens[:-1] start at 0 .. length - 1 - n: every occurrence but the suffix
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
