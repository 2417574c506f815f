"""Expert load of MoE models: how many token assignments each expert of each sparse layer took,
and how uneven that is. What expert-parallel load balancing acts on, made visible first.

The runner reports each step's counts (ModelRunnerOutput.expert_load); the scheduler keeps the
running totals here, SchedulerStats carries them to /metrics, the periodic log and `kvtide bench`.

    imbalance of a layer = max over experts / mean over experts of its assignments
                           (1.0: perfectly even; num_experts: everything on one expert)
"""

from __future__ import annotations

from dataclasses import dataclass, field


def imbalance(counts: list[int]) -> float | None:
    """max / mean of one layer's per-expert counts; None before any token was routed."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else None


@dataclass
class ExpertLoadStats:
    layers: list[int]
    """The model's sparse layers (decoder layer indices), in the order the counts come."""
    num_experts: int
    tokens: list[list[int]] = field(default_factory=list)
    """tokens[i][e]: assignments routed to expert e of sparse layer layers[i] so far."""
    dropped: list[list[int]] = field(default_factory=list)
    """Assignments skipped by the capacity cap (--moe-capacity-factor), same layout."""

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = [[0] * self.num_experts for _ in self.layers]
            self.dropped = [[0] * self.num_experts for _ in self.layers]

    def add(self, tokens: list[list[int]], dropped: list[list[int]]) -> None:
        for totals, step in ((self.tokens, tokens), (self.dropped, dropped)):
            for row, new in zip(totals, step, strict=True):
                for e, n in enumerate(new):
                    row[e] += n

    def as_dict(self) -> dict:
        return {"layers": list(self.layers), "tokens": [list(r) for r in self.tokens],
                "dropped": [list(r) for r in self.dropped]}


def summarize(load: dict | None, since: dict | None = None) -> dict | None:
    """Figures of the counts in `load` (an ExpertLoadStats.as_dict()), less those in `since`: per
    layer imbalance, the worst layer and its hottest expert, assignments and drops in all. None when
    nothing was routed."""
    if load is None:
        return None
    tokens = load["tokens"]
    dropped = load["dropped"]
    if since is not None:
        tokens = [[a - b for a, b in zip(r, s, strict=True)] for r, s in zip(tokens, since["tokens"], strict=True)]
        dropped = [[a - b for a, b in zip(r, s, strict=True)] for r, s in zip(dropped, since["dropped"], strict=True)]
    per_layer = [imbalance(r) for r in tokens]
    known = [(v, i) for i, v in enumerate(per_layer) if v is not None]
    if not known:
        return None
    worst_value, worst = max(known)
    row = tokens[worst]
    return {"imbalance_per_layer": per_layer, "max_imbalance": worst_value,
            "mean_imbalance": sum(v for v, _ in known) / len(known),
            "worst_layer": load["layers"][worst], "hottest_expert": row.index(max(row)),
            "assignments": sum(map(sum, tokens)), "dropped": sum(map(sum, dropped))}
