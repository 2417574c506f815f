"""How many draft tokens each request verifies each step: adaptive, per request and per step.

With a per-token acceptance rate a and k drafts, a verification step emits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens (Leviathan et al.) and costs about 1 + c*k target steps, c
being a draft token's proposal cost plus its verification cost. Each request gets the k in
[0, K] maximising E(k) / (1 + c*k) for its own measured rate: a request whose drafts are accepted
grows towards K; one whose drafts are rejected shrinks to 1 and then to 0 (no speculation), from
where its estimate relaxes back towards the prior so it is probed again later. A step with more
decoding requests than `disable_by_batch_size` speculates for none (verification stops being
nearly free once the batch is compute-bound), and a request with SamplingParams(speculation=False)
never does.

The rate is a decayed count of accepted and rejected draft positions plus a prior:
    a = (S + PRIOR_RATE * PRIOR_WEIGHT) / (S + F + PRIOR_WEIGHT)
Pure Python (the scheduler imports it; it must not pull in device code).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtide.spec_decode.config import SpeculativeConfig

PRIOR_RATE = 0.6
"""Acceptance assumed before a request has verified anything."""
PRIOR_WEIGHT = 2.0
"""Pseudo-observations the prior is worth."""
DECAY = 0.8
"""Weight of older observations per step: the estimate follows a request's recent text."""
VERIFY_COST = 0.05
"""Cost of one more verified token per request, as a fraction of a decode step, in a batch under
disable_by_batch_size (measured on CPU: docs/benchmarks.md)."""
RELAX = 0.1
"""Per step without speculation, how far the estimate moves back towards the prior."""


def expected_tokens(rate: float, k: float) -> float:
    """Expected tokens emitted by one verification of k drafts with i.i.d. per-token acceptance
    `rate`: (1 - rate^(k+1)) / (1 - rate); k + 1 at rate 1."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"acceptance rate must lie in [0, 1], got {rate}")
    if k < 0:
        raise ValueError(f"draft length must be >= 0, got {k}")
    if rate == 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def best_draft_length(rate: float, max_k: int, cost: float) -> int:
    """The k in [0, max_k] with the most expected tokens per unit of step cost."""
    best_k, best = 0, 1.0
    for k in range(1, max_k + 1):
        value = expected_tokens(rate, k) / (1.0 + cost * k)
        if value > best + 1e-9:
            best_k, best = k, value
    return best_k


@dataclass
class AcceptanceStats:
    """One request's decayed counts of accepted and rejected draft positions."""

    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = self.accepted * DECAY + num_accepted
        self.rejected = self.rejected * DECAY + (1 if num_accepted < num_drafted else 0)

    def relax(self) -> None:
        self.accepted *= 1.0 - RELAX
        self.rejected *= 1.0 - RELAX


class SpecDecodePolicy:
    def __init__(self, config: SpeculativeConfig, draft_cost: float) -> None:
        self.config = config
        self.cost = draft_cost + VERIFY_COST

    def speculates(self, num_decodes: int) -> bool:
        """Whether a step with this many decoding requests speculates at all."""
        return num_decodes <= self.config.disable_by_batch_size

    def num_draft_tokens(self, stats: AcceptanceStats) -> int:
        """Drafts for a request this step (before the caps of its budget, length and max_tokens)."""
        k = self.config.num_speculative_tokens
        if not self.config.adaptive:
            return k
        n = best_draft_length(stats.rate, k, self.cost)
        if n == 0:
            stats.relax()
        return n
