"""Which rank of the expert-parallel group holds each expert of a MoE layer, and in which slot.

The table is per expert a list of replicas, (rank, local slot) each; a rank's slots hold its experts
in ascending expert id, so its stacked weights are `w13_weight[slot]`. The default is contiguous
blocks, one replica each (vLLM's linear expert placement):

    E 8, ep_size 2     owners  [0, 0, 0, 0, 1, 1, 1, 1]     slots [0, 1, 2, 3, 0, 1, 2, 3]

A load balancer changes the table by building another one (`from_owners`, `from_replicas`) before
the layer allocates and loads its weights; moving weights between ranks at run time is not done
here. A replicated expert (a hot one placed on several ranks) takes each token's assignment on
replica `token_index % num_replicas`, so its tokens are spread evenly over the replicas and every
rank computes the same choice without exchanging anything.

Dispatch addresses slots by a group-wide key: rank q's slot s is key `slot_offset[q] + s`, so one
sort by key groups a rank's outgoing rows by destination, and within it by local expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ExpertPlacement:
    """expert id -> its replicas' (owner rank, local slot) over an expert-parallel group of
    `ep_size` ranks. Built once per layer; identical on every rank (it is derived from arguments
    every rank has), so no rank ever asks another where an expert lives."""

    def __init__(self, replicas: Sequence[Sequence[int]], ep_size: int) -> None:
        """`replicas[e]`: the ranks holding expert e (the first is its primary owner)."""
        if ep_size < 1:
            raise ValueError(f"ep_size must be >= 1; got {ep_size}")
        if not replicas:
            raise ValueError("an expert placement needs at least one expert")
        for expert, ranks in enumerate(replicas):
            if not ranks:
                raise ValueError(f"expert {expert} has no owner rank")
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"expert {expert} lists a rank twice: {list(ranks)}")
            bad = [r for r in ranks if not 0 <= r < ep_size]
            if bad:
                raise ValueError(f"expert {expert}: ranks {bad} are outside the group of {ep_size}")
        self.num_experts = len(replicas)
        self.ep_size = ep_size
        self.replicas: list[tuple[tuple[int, int], ...]] = []
        """Per expert, its replicas' (rank, local slot)."""
        self._local: list[list[int]] = [[] for _ in range(ep_size)]
        for expert, ranks in enumerate(replicas):
            entry = []
            for rank in ranks:
                entry.append((rank, len(self._local[rank])))
                self._local[rank].append(expert)
            self.replicas.append(tuple(entry))
        self.num_local_experts = [len(local) for local in self._local]
        """Slots per rank: the first dimension of that rank's stacked weights."""
        offsets = [0]
        for count in self.num_local_experts:
            offsets.append(offsets[-1] + count)
        self.slot_offset = offsets[:-1]
        """Rank q's first group-wide slot key."""
        self.num_slots = offsets[-1]

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """Rank r holds experts [r * E / n, (r + 1) * E / n): equal blocks, one replica each."""
        if num_experts < 1 or ep_size < 1:
            raise ValueError(f"num_experts ({num_experts}) and ep_size ({ep_size}) must be >= 1")
        if num_experts % ep_size:
            raise ValueError(f"num_experts {num_experts} is not divisible by the expert-parallel size "
                             f"{ep_size}: expert parallelism places E / n whole experts on each rank")
        per_rank = num_experts // ep_size
        return cls([[e // per_rank] for e in range(num_experts)], ep_size)

    @classmethod
    def from_owners(cls, owners: Sequence[int], ep_size: int) -> ExpertPlacement:
        """One replica per expert, expert e on rank `owners[e]` (a balancer's explicit table)."""
        return cls([[int(owner)] for owner in owners], ep_size)

    @classmethod
    def from_replicas(cls, replicas: Sequence[Sequence[int]], ep_size: int) -> ExpertPlacement:
        """Hot experts on several ranks: `replicas[e]` lists the ranks holding expert e."""
        return cls(replicas, ep_size)

    # ---- queries ----------------------------------------------------------------------------------
    def local_experts(self, rank: int) -> list[int]:
        """The global expert ids rank `rank` holds, by local slot."""
        return list(self._local[rank])

    def owners(self, expert: int) -> list[int]:
        return [rank for rank, _ in self.replicas[expert]]

    def expert_map(self, rank: int) -> torch.Tensor:
        """(E,) int64: each expert's slot on `rank`, -1 where `rank` holds no replica (vLLM's
        `expert_map`)."""
        mapping = torch.full((self.num_experts,), -1, dtype=torch.int64)
        for slot, expert in enumerate(self._local[rank]):
            mapping[expert] = slot
        return mapping

    def slot_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dispatch's tables: keys (E + 1, R) int64, replica j of expert e's group-wide slot key
        (row E, the "no expert" id capacity drops carry, is `num_slots`: past every rank), and
        num_replicas (E + 1,) int64 (columns past an expert's replicas repeat its first)."""
        width = max(len(r) for r in self.replicas)
        keys = torch.full((self.num_experts + 1, width), self.num_slots, dtype=torch.int64)
        num_replicas = torch.ones(self.num_experts + 1, dtype=torch.int64)
        for expert, entry in enumerate(self.replicas):
            for j in range(width):
                rank, slot = entry[j] if j < len(entry) else entry[0]
                keys[expert, j] = self.slot_offset[rank] + slot
            num_replicas[expert] = len(entry)
        return keys, num_replicas

    def destinations(self, topk_ids: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """(m, k) global ids in [0, E] of tokens `token_index` (m,) -> (m, k) group-wide slot keys:
        where each assignment is computed (`num_slots` for id E). For byte accounting and tests;
        dispatch uses the same rule on cached tables."""
        keys, num_replicas = self.slot_keys()
        keys, num_replicas = keys.to(topk_ids.device), num_replicas.to(topk_ids.device)
        replica = token_index.to(topk_ids.device).unsqueeze(1) % num_replicas[topk_ids]
        return keys[topk_ids, replica]

    def rank_of_key(self, keys: torch.Tensor) -> torch.Tensor:
        """Group-wide slot keys -> the rank holding that slot (`ep_size` for `num_slots`)."""
        bounds = torch.tensor(self.slot_offset[1:] + [self.num_slots], dtype=keys.dtype, device=keys.device)
        return torch.bucketize(keys, bounds, right=True)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ExpertPlacement) and self.ep_size == other.ep_size
                and self.replicas == other.replicas)

    def __repr__(self) -> str:
        owners = [self.owners(e) for e in range(self.num_experts)]
        return f"ExpertPlacement(ep_size={self.ep_size}, replicas={owners})"


def expected_all_to_all_bytes(num_tokens: int, top_k: int, hidden_size: int, ep_size: int,
                              dtype_bytes: int) -> float:
    """The expert-parallel exchange's volume under uniform routing, summed over the group, for one
    layer's forward: dispatch sends each assignment whose expert lives on another rank once, combine
    returns it, so 2 x T x k x H x (n - 1) / n x bytes (an assignment's expert is on one of n equal
    blocks, only its own rank's is free)."""
    return 2 * num_tokens * top_k * hidden_size * (ep_size - 1) / ep_size * dtype_bytes


def all_to_all_bytes(topk_ids: torch.Tensor, placement: ExpertPlacement, hidden_size: int,
                     dtype_bytes: int) -> int:
    """The exact volume of one forward with routing `topk_ids` (T, k) (after capacity drops),
    summed over the group: 2 x (assignments computed on a rank other than the one whose token share
    holds them) x H x bytes."""
    from kvtide.distributed import split_evenly

    num_tokens = topk_ids.shape[0]
    if num_tokens == 0:
        return 0
    token_index = torch.arange(num_tokens, device=topk_ids.device)
    dest = placement.rank_of_key(placement.destinations(topk_ids, token_index))  # (T, k)
    source = torch.empty(num_tokens, dtype=torch.int64, device=topk_ids.device)
    for rank in range(placement.ep_size):
        start, size = split_evenly(num_tokens, placement.ep_size, rank)
        source[start:start + size] = rank
    remote = ((dest != source.unsqueeze(1)) & (topk_ids < placement.num_experts)).sum().item()
    return 2 * int(remote) * hidden_size * dtype_bytes
