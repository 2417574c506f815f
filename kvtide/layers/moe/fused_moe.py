"""The experts' compute in torch: the T * k (token, expert) assignments grouped by expert, one pair
of matmuls per expert that has tokens, and the optional per-expert capacity limit.

    topk_ids  [[2, 0], [0, 3], [2, 0]]        T = 3 tokens, k = 2
    flat      [2, 0, 0, 3, 2, 0]              assignment a = t * k + j
    order     [1, 2, 5, 0, 4, 3]              stable argsort: grouped by expert, tokens in order
    counts    [3, 0, 2, 1]                    bincount: expert 1 has no tokens and costs nothing
    tokens    [0, 1, 2, 0, 2, 1]              order // k: the rows gathered from the hidden states
               \\_e0__/  \\e2/  e3

Each expert's rows are one contiguous slice, so it runs F.linear(x, w13[e]) -> SiLU-and-mul ->
F.linear(., w2[e]) once over all of them; its rows are scaled by their routing weights and added
into their tokens with index_add_. Products and sums follow transformers' MoE experts (the
weight multiplies the down projection's output, in torch's type promotion with the weights'
dtype, then the result is cast to the hidden dtype and accumulated expert by expert), so in float32
and bf16 alike the output matches HF's.

An id equal to num_experts (E) means "no expert": the assignment is skipped, its token passes
through the residual for that choice (capacity drops use it; so could experts on other ranks).

The experts' matmuls see few rows each (decode: 1-2), where BLAS speed depends on the operands'
orientation: on a Zen 4 EPYC (2 threads), MKL's x @ w.T took 0.5-1.0 ms for a (2048, 768) weight at
1-4 rows (its sgemv and small-M paths) and (w @ x.T).T 0.2-0.25 ms; above that either won by up to
~30% depending on the row count, and odd row counts ran up to 2x slower unless padded. So on
float32 CPU tensors `expert_linear` measures both once per weight shape, row bucket and thread
count (the first forwards on a machine pay for it, ~10-50 ms per shape; the verdict is kept on disk,
gemm_tuning.py, so ranks and restarts run the same products) and keeps the faster; elsewhere it is
F.linear. Either way the products are float32 sgemm's, equal up to summation order. Under
--cpu-weight-prepack, the experts' weights are linears like any other to cpu_gemm.prepack_weights
(FusedMoE.gemm_views): a packed kernel measured faster there (oneDNN's brgemm ran the 16-row
products of a 64-request decode 1.3-2x faster than either orientation of sgemm) runs instead.
Where that kernel is kvtide's panel kernel, the whole loop runs as one compiled call instead
(fused_experts_on_panels, FusedMoE.use_expert_panels): per step and layer it saves the host sync,
~10 op dispatches per active expert and the threads' wait after each small GEMM, which on the
Mixtral bench shape were about a tenth of the step.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from kvtide.layers import gemm_tuning, layer_ops
from kvtide.layers.cpu_gemm import GemmPlan

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Upper bounds of the row-count buckets of expert_linear's choice; more rows: F.linear."""
MARGIN = 0.03
"""The weight-major product must beat F.linear by this fraction to be chosen."""
MEASURE_BYTES = 48 << 20
"""At most this much of the experts' weights per measured round: beyond the last-level cache, so
the weights stream from memory as in a forward."""
MEASURE_FLOPS = 0.5e9
"""At most this many FLOPs per measured round (larger row counts are compute-bound: one weight)."""
_WEIGHT_MAJOR_WINS: dict[tuple[int, int, int, int], bool] = {}
"""(N, K, bucket, torch threads) -> whether (w @ x.T).T measured faster than F.linear(x, w)."""


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the T * k assignments (a = t * k + j) sorted by expert, stably so each
    expert's tokens stay in order, and the count per id 0..E (E: skipped, sorted last)."""
    flat_ids = topk_ids.reshape(-1)
    return torch.argsort(flat_ids, stable=True), torch.bincount(flat_ids, minlength=num_experts + 1)


def fused_experts(hidden_states: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  plans: list[tuple[GemmPlan | None, GemmPlan | None]] | None = None) -> torch.Tensor:
    """hidden (T, H), w13 (E, 2I, H) = [gate; up] rows, w2 (E, H, I), topk_* (T, k) -> (T, H):
    sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e][:I] @ x) * (w13[e][I:] @ x)) with e = topk_ids[t, j].

    topk_ids in [0, E]; E skips the assignment. One host sync (the per-expert counts). `plans`:
    per expert, the CPU GEMM kernels (layers/cpu_gemm.py) chosen for its w13 and w2 at load, with
    their packed copies; None (or a None plan): expert_linear. Quantized experts
    (quantized_experts.py) come as sequences of E QuantizedWeights with their kernel as every plan."""
    num_tokens, top_k = topk_ids.shape
    num_experts = len(w13)
    two_i = w13.shape[1] if isinstance(w13, torch.Tensor) else w13[0].out_features
    intermediate = two_i // 2
    out = torch.zeros_like(hidden_states)
    if num_tokens == 0:
        return out
    order, counts_t = group_by_expert(topk_ids, num_experts)
    counts = counts_t.tolist()  # the one sync
    num_routed = len(order) - counts[num_experts]  # assignments to id E sort last and are dropped
    if num_routed == 0:
        return out
    order = order[:num_routed]
    token_idx = order // top_k  # (num_routed,)
    x_sorted = hidden_states.index_select(0, token_idx)  # (num_routed, H)
    weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)  # (num_routed, 1)
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        end = start + count
        plan13, plan2 = plans[expert] if plans is not None else (None, None)
        x = x_sorted[start:end]
        gate_up = plan13(x, w13[expert], None) if plan13 is not None else expert_linear(x, w13[expert], w13)
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        down = plan2(act, w2[expert], None) if plan2 is not None else expert_linear(act, w2[expert], w2)
        # down * weight in promoted precision (float32 weights: as Mixtral/DeepSeek), then the hidden
        # dtype; one index_add_ per expert, as HF: a single one over all rows would sum a token's
        # k rows in float32 and round once, not once per expert as HF does in bf16.
        out.index_add_(0, token_idx[start:end], (down * weights[start:end]).to(out.dtype))
        start = end
    return out


def fused_experts_on_panels(hidden_states: torch.Tensor, panels: tuple[torch.Tensor, torch.Tensor],
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_experts on float32 CPU tensors in one compiled call (layer_ops.moe_experts), from
    pack_panels of w13 and w2: no host sync, no per-expert op dispatch, the two GEMM phases each
    spread over all (expert, panel) pairs. Same grouping, products and summation order per token
    as fused_experts; the GEMMs' own sums in another order (the panel kernel's)."""
    w13_panels, w2_panels = panels
    num_experts = w13_panels.shape[0]
    intermediate = w2_panels.shape[2]
    order, counts = group_by_expert(topk_ids, num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    torch.cumsum(counts[:num_experts], 0, out=offsets[1:])
    weights = topk_weights.reshape(-1).to(torch.float32).index_select(0, order)
    return layer_ops.moe_experts(hidden_states, order // topk_ids.shape[1], weights, offsets, w13_panels,
                                 w2_panels, intermediate)


def expert_linear(x: torch.Tensor, w: torch.Tensor, stacked: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w): x (M, K), w (N, K) -> (M, N), on float32 CPU tensors of M <= 256 rows as
    whichever of x @ w.T and (w @ x.T).T (rows padded: weight_major_linear) measured faster for
    this shape and row bucket. `stacked` (E, N, K), the experts' weights w belongs to: measured over
    several of them, so that the weights stream from memory as in a forward, not from the cache."""
    rows = x.shape[0]
    if x.dtype != torch.float32 or x.device.type != "cpu" or not 0 < rows <= ROW_BUCKETS[-1]:
        return F.linear(x, w)
    bucket = next(b for b in ROW_BUCKETS if rows <= b)
    key = (w.shape[0], w.shape[1], bucket, torch.get_num_threads())
    wins = _WEIGHT_MAJOR_WINS.get(key)
    if wins is None:
        wins = _WEIGHT_MAJOR_WINS[key] = _weight_major_wins(w[None] if stacked is None else stacked, bucket)
    return weight_major_linear(x, w) if wins else F.linear(x, w)


def weight_major_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(w @ x.T).T with x row-major (a column-major x is the slow case), its rows padded with zeros
    to 2 (from 1) or to a multiple of 8 (from 5 up): odd row counts ran up to 2x slower."""
    rows = x.shape[0]
    padded = 2 if rows == 1 else rows if rows <= 4 else rows + (-rows) % 8
    if padded != rows:
        x_padded = x.new_zeros(padded, x.shape[1])
        x_padded[:rows] = x
        x = x_padded
    return torch.mm(w, x.contiguous().t()).t()[:rows]


def _weight_major_wins(stacked: torch.Tensor, rows: int) -> bool:
    """This machine's verdict for the shape of `stacked` (E, N, K) at `rows` rows: read from the disk
    cache, else measured and kept there."""
    key = gemm_tuning.expert_key()
    path = gemm_tuning.cache_path(key)
    name = f"{stacked.shape[1]}x{stacked.shape[2]}/{rows}"
    wins = gemm_tuning.load_expert_verdicts(path).get(name)
    if wins is None:
        wins = _weight_major_is_faster(stacked, rows)
        gemm_tuning.save_expert_verdict(path, key, name, wins)
    return wins


def _weight_major_is_faster(stacked: torch.Tensor, rows: int, rounds: int = 5) -> bool:
    """Time both products over a few of the weights in `stacked` (E, N, K), in interleaved rounds."""
    _, n, k = stacked.shape
    count = int(min(16, MEASURE_BYTES // stacked[0].nbytes, MEASURE_FLOPS // (2 * rows * n * k)))
    weights = list(stacked[:max(1, count)])
    x = torch.randn(rows, k)
    best = {F.linear: math.inf, weight_major_linear: math.inf}
    for fn in best:  # warm-up
        fn(x, weights[0])
    for _ in range(rounds):  # interleaved; the best round counts (interference only adds time)
        for fn in best:
            start = time.perf_counter()
            for w in weights:
                fn(x, w)
            best[fn] = min(best[fn], time.perf_counter() - start)
    return best[weight_major_linear] < best[F.linear] * (1 - MARGIN)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """ceil(capacity_factor * T * top_k / E): the assignments one expert takes per forward."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0; got {capacity_factor}")
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def apply_capacity(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                   capacity_factor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert keeps at most `expert_capacity(...)` assignments of this forward, the earliest
    tokens first (a token's choices are kept or dropped independently); a dropped assignment gets
    weight 0 and id E, so fused_experts skips it and the token passes through the residual for that
    choice (its other choices still count, and are not renormalized).

    -> (topk_weights, topk_ids) with the drops applied (new tensors), and dropped (E,) int64: the
    assignments each expert dropped. Sync-free: the ranks come from one stable sort.

    capacity 1, topk_ids [[0, 1], [0, 2], [1, 0]] -> [[0, 1], [E, 2], [E, E]], dropped [2, 1, 0]"""
    num_tokens, top_k = topk_ids.shape
    capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    flat_ids = topk_ids.reshape(-1)
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts]  # (E,)
    dropped = (counts - capacity).clamp_min(0)
    if num_tokens * top_k <= capacity:  # nothing can overflow
        return topk_weights, topk_ids, dropped
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    starts = torch.cumsum(counts, 0) - counts  # (E,) first sorted position of each expert
    starts = torch.cat([starts, starts.new_zeros(1)])  # id E: never dropped again (rank unused)
    rank_sorted = torch.arange(len(order), device=flat_ids.device) - starts[sorted_ids]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted).view_as(topk_ids)
    drop = (rank >= capacity) & (topk_ids < num_experts)
    topk_ids = topk_ids.masked_fill(drop, num_experts)
    topk_weights = topk_weights.masked_fill(drop, 0.0)
    return topk_weights, topk_ids, dropped
