"""Speculative decoding counters, named as vLLM names them (kvtide: prefix on the server).

    num_drafts                  verification steps of a request that had drafts
    num_draft_tokens            draft tokens proposed and verified
    num_accepted_tokens         draft tokens accepted
    accepted_per_pos[i]         drafts accepted at position i of their run
    num_rejections              drafts with a rejected token (the others were accepted whole)
The mean accepted length is 1 + accepted / drafts (the bonus or corrected token included), the
acceptance rate accepted / draft tokens (vLLM's). The tokens drafted after a rejection count as
drafted, so that rate understates the chance a draft token is accepted given the ones before it
were; accepted / (accepted + rejections) estimates that (the a of Leviathan et al.'s
E = (1 - a^(k+1)) / (1 - a)). Pure Python: the scheduler owns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_speculative_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_rejections += num_accepted < num_drafted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "num_rejections": self.num_rejections,
                "accepted_per_pos": list(self.accepted_per_pos)}


def summarize(counters: dict | None) -> dict[str, float] | None:
    """Counters (SpecDecodingStats.as_dict, or the difference of two) -> the figures people read."""
    if not counters or not counters.get("num_drafts"):
        return None
    drafts, drafted, accepted = counters["num_drafts"], counters["num_draft_tokens"], counters["num_accepted_tokens"]
    rejections = counters.get("num_rejections")
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "mean_accepted_length": 1.0 + accepted / drafts,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "per_token_acceptance": None if rejections is None else accepted / max(accepted + rejections, 1),
            "acceptance_rate_per_pos": [n / drafts for n in counters["accepted_per_pos"]]}


def difference(new: dict | None, old: dict | None) -> dict | None:
    """Counters accumulated between two snapshots."""
    if new is None:
        return None
    if old is None:
        return new
    out = {key: new[key] - old[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                                "num_rejections") if key in new and key in old}
    out["accepted_per_pos"] = [a - b for a, b in zip(new["accepted_per_pos"], old["accepted_per_pos"], strict=True)]
    return out
