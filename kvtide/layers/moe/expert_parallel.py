"""Expert parallelism's token exchange: each rank of the EP group holds whole experts, so a token's
hidden row travels to the ranks holding its chosen experts and its results travel back.

Every rank enters a MoE layer with the same T hidden rows (attention's output is all-reduced over
the TP group, which is the EP group) and the same routing (the router is replicated). Each rank
takes its contiguous share of the rows, so the group sends every assignment once:

    rank r, share [s, s + m)         (split_evenly: shares differ by at most one row; may be empty)
    1. keys      each (token, choice) -> the group-wide slot key of the replica computing it
                 (placement.py); a stable sort by key groups the rows by destination rank and, within
                 it, by local expert, tokens in order
    2. counts    all_to_all of the per-slot counts (rank q gets the counts of its own slots from every
                 rank): the receiver learns its row splits and each row's local expert from them
    3. dispatch  all_to_all of the hidden rows
    4. experts   fused_experts over the received rows, one choice each with weight 1: the down
                 projection's output exactly, in the order the world-size-1 layer computes it
    5. combine   the reverse all_to_all; the source scales each row by its top-k weight and adds a
                 token's rows in ascending expert id, as fused_experts' per-expert index_add_ does
    6. gather    all_gather of the shares (padded to ceil(T / n) rows), so all ranks hold all T rows

An expert's rows arrive from rank 0's share first, then rank 1's, ...: the global token order, the
same matrix the world-size-1 layer multiplies. So the products and the summation order are those of
world size 1, and in practice the output is bitwise equal (tests allow rounding-level drift).

Volume per layer (summed over the group): 2 x (assignments computed away from their share's
rank) x H x dtype bytes for dispatch + combine (`placement.all_to_all_bytes`; under uniform routing
2 x T x k x H x (n - 1) / n, `expected_all_to_all_bytes`), plus the counts (n x slots int64) and the
gather ((n - 1) x ceil(T / n) x H per rank). `AllToAllDispatcher.bytes` keeps each figure as the
group coordinator counts it (COMM_STATS sums them all under `tp.all_to_all` / `tp.all_gather`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from kvtide.distributed import GroupCoordinator, split_evenly
from kvtide.layers.moe.placement import ExpertPlacement


@dataclass
class Dispatched:
    """What a rank's experts compute after dispatch, and what combine needs to send it back."""

    hidden_states: torch.Tensor
    """(R, H) rows received for this rank's experts, grouped by source rank then local expert."""
    topk_weights: torch.Tensor
    """(R, 1) float32 ones: the weights are applied at the source, in world size 1's precision."""
    topk_ids: torch.Tensor
    """(R, 1) each row's local slot."""
    num_tokens: int
    share_start: int
    share_size: int
    order: torch.Tensor
    """(S,) the sent assignments, as flat indices t * k + j into this rank's share."""
    send_splits: list[int]
    recv_splits: list[int]
    share_weights: torch.Tensor
    """(m, k) this share's top-k weights."""
    share_ids: torch.Tensor
    """(m, k) this share's global expert ids (E: dropped)."""


class AllToAllDispatcher:
    """Dispatch and combine for one MoE layer over `group` (vLLM's all2all "prepare / finalize")."""

    def __init__(self, group: GroupCoordinator, placement: ExpertPlacement, tokens_shared: bool = True) -> None:
        if placement.ep_size != group.world_size:
            raise ValueError(f"the expert placement is for {placement.ep_size} ranks, the EP group has "
                             f"{group.world_size}")
        self.group = group
        self.placement = placement
        self.tokens_shared = tokens_shared
        """True: every rank holds the same T rows (the EP group is a replica's TP group) and computes
        its share. False: the EP group spans data-parallel replicas, each with its own batch (an
        idle one with none): a rank dispatches all of its rows and keeps its combined output, no
        gather; every rank enters every exchange, whatever its T."""
        self.rank = group.rank_in_group
        self.num_local = placement.num_local_experts
        self._keys, self._num_replicas = placement.slot_keys()
        self.bytes: dict[str, int] = defaultdict(int)
        """Bytes this rank sent, per exchange ("counts", "dispatch", "combine", "all_gather"), as the
        group coordinator counts them; they only grow."""

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._keys.device != device:
            self._keys, self._num_replicas = self._keys.to(device), self._num_replicas.to(device)
        return self._keys, self._num_replicas

    def _all_to_all(self, kind: str, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                    input_splits: list[int]) -> torch.Tensor:
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        self.bytes[kind] += row_bytes * (sum(input_splits) - input_splits[self.rank])
        return self.group.all_to_all(output, input, output_splits, input_splits)

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> Dispatched:
        """hidden (T, H), topk_* (T, k) with global ids (E: dropped), the same on every rank ->
        the rows this rank's experts compute, with their local ids."""
        num_tokens, top_k = topk_ids.shape
        n, me = self.group.world_size, self.rank
        if num_tokens == 0 and self.tokens_shared:  # every rank has the same T: all skip the exchange
            nothing = torch.empty(0, 1, dtype=torch.int64, device=hidden_states.device)
            return Dispatched(hidden_states, nothing.float(), nothing, 0, 0, 0, nothing.view(0), [0] * n,
                              [0] * n, topk_weights, topk_ids)
        start, size = split_evenly(num_tokens, n, me) if self.tokens_shared else (0, num_tokens)
        device = hidden_states.device
        share_ids = topk_ids[start:start + size]
        keys, num_replicas = self._tables(device)
        token_index = torch.arange(start, start + size, device=device).unsqueeze(1)
        flat_keys = keys[share_ids, token_index % num_replicas[share_ids]].reshape(-1)  # (m * k,)
        order = torch.argsort(flat_keys, stable=True)
        slot_counts = torch.bincount(flat_keys, minlength=self.placement.num_slots + 1)[:-1]
        counts = slot_counts.tolist()
        offsets = self.placement.slot_offset
        send_splits = [sum(counts[offsets[q]:offsets[q] + self.num_local[q]]) for q in range(n)]
        order = order[:sum(send_splits)]  # dropped assignments (key num_slots) sort last
        send_rows = hidden_states[start:start + size].index_select(0, order // top_k)

        recv_counts = slot_counts.new_empty(n * self.num_local[me])
        self._all_to_all("counts", recv_counts, slot_counts, [self.num_local[me]] * n, self.num_local)
        received = recv_counts.view(n, self.num_local[me])
        recv_splits = received.sum(1).tolist()
        recv_rows = hidden_states.new_empty(sum(recv_splits), hidden_states.shape[1])
        self._all_to_all("dispatch", recv_rows, send_rows, recv_splits, send_splits)

        local_ids = torch.arange(self.num_local[me], device=device).repeat(n)
        local_ids = torch.repeat_interleave(local_ids, recv_counts).unsqueeze(1)
        ones = torch.ones(local_ids.shape, dtype=torch.float32, device=device)
        return Dispatched(recv_rows, ones, local_ids, num_tokens, start, size, order, send_splits, recv_splits,
                          topk_weights[start:start + size], share_ids)

    def combine(self, expert_out: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """The experts' (R, H) outputs for the received rows -> (T, H), every token's weighted sum
        over its choices, on every rank."""
        hidden = expert_out.shape[1]
        if d.num_tokens == 0 and self.tokens_shared:
            return expert_out.new_zeros(0, hidden)
        returned = expert_out.new_empty(sum(d.send_splits), hidden)
        self._all_to_all("combine", returned, expert_out, d.send_splits, d.recv_splits)
        size, top_k = d.share_ids.shape
        weights = d.share_weights.reshape(-1).index_select(0, d.order).unsqueeze(1)
        contrib = expert_out.new_zeros(size * top_k, hidden)
        # weight times down projection in promoted precision, then the hidden dtype: as fused_experts
        contrib[d.order] = (returned * weights).to(contrib.dtype)
        # a token's choices added in ascending expert id, from zero: fused_experts' index_add_ order
        by_expert = torch.argsort(d.share_ids, dim=1, stable=True)
        contrib = torch.take_along_dim(contrib.view(size, top_k, hidden), by_expert.unsqueeze(2), dim=1)
        share_out = expert_out.new_zeros(size, hidden)
        for j in range(top_k):
            share_out += contrib[:, j]
        return self._gather_shares(share_out, d.num_tokens) if self.tokens_shared else share_out

    def _gather_shares(self, share_out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Every rank's share, in rank order: (T, H). Shares are padded to the largest one, since
        all_gather moves equal sizes."""
        n = self.group.world_size
        padded = -(-num_tokens // n)
        if share_out.shape[0] < padded:
            padding = share_out.new_zeros(padded - share_out.shape[0], share_out.shape[1])
            share_out = torch.cat([share_out, padding])
        self.bytes["all_gather"] += share_out.numel() * share_out.element_size() * (n - 1)
        gathered = self.group.all_gather(share_out.contiguous(), dim=0)  # (n * padded, H)
        if padded * n == num_tokens:
            return gathered
        rows = [torch.arange(q * padded, q * padded + split_evenly(num_tokens, n, q)[1]) for q in range(n)]
        return gathered.index_select(0, torch.cat(rows).to(gathered.device))
