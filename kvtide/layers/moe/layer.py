"""`FusedMoE`: a sparse MLP block's routed experts, with their weights stacked per expert.

    router_logits (T, E) ──select_experts──▶ topk_weights, topk_ids (T, k)
                                              │ expert_tokens += bincount(ids); capacity drops
    hidden (T, H) ──dispatch──▶ local experts (fused_experts, or the Triton kernel on CUDA) ──combine──▶ (T, H)

Dispatch and combine are all-to-alls under expert parallelism (`--enable-expert-parallel`: the EP
group, which is the TP group, splits whole experts; expert_parallel.py), nothing at one rank. Routing,
the load counters and the capacity cap are global and computed alike on every rank.

Under tensor parallelism without expert parallelism the experts are split by their intermediate
dimension instead (vLLM's TP MoE): every rank holds every expert, its 1/tp slice of each

    w13 (E, 2I, H) -> (E, 2I/tp, H)   [gate rows r*I/tp..; up rows I + r*I/tp..], as MergedColumnParallelLinear
    w2  (E, H, I)  -> (E, H, I/tp)    columns r*I/tp.., as RowParallelLinear

so its output is a partial sum (`partial_output`); the model adds its shared experts' partial
products and all-reduces the block once (models/sparse_moe.py). No tokens move.

The router linear and any shared experts belong to the model (they differ between architectures:
Qwen2-MoE gates its shared expert with a sigmoid, DeepSeek adds n_shared_experts plainly).

Weights, in transformers' fused layout (HF 5.x `experts.gate_up_proj` / `down_proj`):

    w13_weight (E_local, 2I, H)   rows [0, I): expert e's gate_proj / w1, rows [I, 2I): its up_proj / w3
    w2_weight  (E_local, H, I)    expert e's down_proj / w2

E_local is E at one rank; I is the per-rank intermediate size (`local_intermediate_size`, I/tp
under tensor-parallel experts); under expert parallelism the experts this rank holds (`local_experts`,
from the `ExpertPlacement`, placement.py), slot s holding expert local_experts[s]. A checkpoint's
per-expert tensors load through `param.weight_loader(param, tensor, shard_id)` with shard_id
(e, "w1"), (e, "w3") or (e, "w2") and global e (another rank's expert: ignored, its lazily read
tensor never read); None loads a whole stacked (E, ...) tensor, this rank's experts taken from it.
Tensor-parallel experts read only their rows (w1, w3) or columns (w2) of each expert's tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtide.distributed import experts_span_replicas, get_ep_group, get_layout, get_tp_group
from kvtide.layers import layer_ops
from kvtide.layers.cpu_gemm import shape_key
from kvtide.layers.linear import default_weight_loader, divide, take
from kvtide.layers.moe.expert_parallel import AllToAllDispatcher, Dispatched
from kvtide.layers.moe.fused_moe import apply_capacity, fused_experts, fused_experts_on_panels
from kvtide.layers.moe.placement import ExpertPlacement
from kvtide.layers.moe.quantized_experts import ExpertQuantizer, QuantizedExperts
from kvtide.layers.moe.routing import select_experts
from kvtide.layers.quantization.base import drop_parameters
from kvtide.layers.quantization.qweight import QuantizedWeight
from kvtide.layers.quantization.weight_only import quantized_linear

FUSE_BUCKET = "9-64"
"""The cpu_gemm row bucket whose kernel choice decides use_expert_panels (a 64-request decode gives
each of 8 experts top-2 about 16 rows)."""
EXPERT_SHARDS = {"w13_weight": ("w1", "w3"), "w2_weight": ("w2",)}
"""The shard names each stacked parameter takes (vLLM's names: w1 = gate, w3 = up, w2 = down)."""


class ExpertGemmView:
    """One expert's projection seen as a bias-free linear by cpu_gemm.prepack_weights."""

    __slots__ = ("weight", "bias", "gemm_plan", "quant_method")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.bias = None
        self.gemm_plan = None
        self.quant_method = None


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: route, dispatch, compute, combine.

    The routing arguments are select_experts' (routing.py has the table of HF config fields per
    architecture); `weights_in_logits_dtype` casts the top-k weights to the router logits' dtype
    before they scale the expert outputs, as Qwen2/3-MoE do (Mixtral and DeepSeek keep float32).
    `capacity_factor` (None: no limit) caps each expert at ceil(capacity_factor * T * top_k / E)
    assignments per forward; the later tokens' assignments beyond it are dropped (fused_moe.py).

    Expert parallelism is taken from the process groups at construction: with
    `enable_expert_parallel` and an EP group of n > 1 ranks, this rank allocates and loads only the
    experts `placement` gives it (default: contiguous blocks of E / n; E not divisible by n is a
    ValueError) and exchanges tokens with the others in every forward (`dispatcher`). `num_experts`
    stays the global E: routing and the counters below are identical on every rank.

    Without expert parallelism, a TP group of n > 1 ranks splits every expert's intermediate
    dimension instead (`tp_size`; `intermediate_size` not divisible by n is a ValueError): the
    forward's output is then this rank's partial sum (`partial_output`), which the caller
    all-reduces. `intermediate_size` stays the global I.

    Expert load, for balancing and capacity planning: the buffers `expert_tokens` (E,) (the
    assignments routed to each expert, counted before capacity drops) and `dropped_tokens` (E,) grow
    every forward while `count_load` is True; `take_expert_load()` reads and zeroes them."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool = False, scoring_func: str = "softmax",
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 group_score: str = "max", use_score_correction_bias: bool = False,
                 routed_scaling_factor: float = 1.0, capacity_factor: float | None = None,
                 weights_in_logits_dtype: bool = False, placement: ExpertPlacement | None = None) -> None:
        super().__init__()
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None; got {capacity_factor}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.scoring_func = scoring_func
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.group_score = group_score
        self.routed_scaling_factor = routed_scaling_factor
        self.capacity_factor = capacity_factor
        self.weights_in_logits_dtype = weights_in_logits_dtype

        ep_group = get_ep_group()
        expert_parallel = get_layout().enable_expert_parallel and ep_group.world_size > 1
        self.ep_size = ep_group.world_size if expert_parallel else 1
        self.ep_rank = ep_group.rank_in_group if expert_parallel else 0
        if placement is None:
            placement = ExpertPlacement.contiguous(num_experts, self.ep_size)
        elif placement.num_experts != num_experts or placement.ep_size != self.ep_size:
            raise ValueError(f"the expert placement is for {placement.num_experts} experts on "
                             f"{placement.ep_size} ranks; this layer has {num_experts} experts on {self.ep_size}")
        self.placement = placement
        self.local_experts: list[int] = placement.local_experts(self.ep_rank)
        """The global ids of the experts this rank computes, by weight slot: all of them at one rank."""
        self.local_num_experts = len(self.local_experts)
        self._slot_of = {expert: slot for slot, expert in enumerate(self.local_experts)}
        self.dispatcher = AllToAllDispatcher(ep_group, placement, tokens_shared=not experts_span_replicas()) \
            if expert_parallel else None
        """The token exchange of expert parallelism; None at one rank."""
        self._dispatched: Dispatched | None = None
        tp_group = get_tp_group()
        self.tp_size = 1 if expert_parallel else tp_group.world_size
        """Ranks splitting each expert's intermediate dimension (1: every expert whole on its rank)."""
        self.tp_rank = 0 if expert_parallel else tp_group.rank_in_group
        self.local_intermediate_size = divide(intermediate_size, self.tp_size, "the experts' intermediate size")

        local, inter = self.local_num_experts, self.local_intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, inter), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            param.reads_slices = True  # type: ignore[attr-defined]  # other ranks' experts stay unread
        if use_score_correction_bias:
            # float32 whatever the model dtype, as HF's DeepseekV3TopkRouter buffer
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("e_score_correction_bias", None)

        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.count_load = True
        self.use_triton = False
        """Run the experts through triton_moe.py's grouped GEMM (CUDA only); set by whoever enables
        the Triton ops."""
        self._gemm_views: list[ExpertGemmView] | None = None
        self.expert_panels: tuple[torch.Tensor, torch.Tensor] | None = None
        """pack_panels of w13 and w2 when the experts run as one compiled call (use_expert_panels)."""
        self.w13_quantized: QuantizedExperts | None = None
        self.w2_quantized: QuantizedExperts | None = None
        """The experts' weights after quantize_experts (then the float parameters are gone)."""
        self.expert_kernel = quantized_linear
        """The quantized experts' GEMM (weight-only, or int8 activations under w8a8)."""

    @property
    def partial_output(self) -> bool:
        """Whether forward returns this rank's partial sum (tensor-parallel experts), to be all-reduced."""
        return self.tp_size > 1

    # ---- weights ----------------------------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy a checkpoint tensor into `param`: one expert's w1 / w3 / w2 (shard_id (e, name), e
        global; another rank's expert is checked and skipped), or the whole parameter (None).
        Shapes must match exactly: ValueError names both. `loaded` may be a lazily read tensor."""
        stacked = param is self.w13_weight or param is self.w2_weight
        if shard_id is None:
            if stacked and self.tp_size > 1:
                self._load_stacked_slice(param, loaded)
                return
            if stacked and self.ep_size > 1:
                expected = (self.num_experts, *param.shape[1:])
                if tuple(loaded.shape) != expected:
                    raise ValueError(f"weight shape mismatch: parameter {expected} vs checkpoint "
                                     f"{tuple(loaded.shape)}")
                rows = [_materialize(loaded.narrow(0, e, 1)) for e in self.local_experts]
                param.data.copy_(torch.cat(rows))
                return
            default_weight_loader(param, _materialize(loaded))
            return
        name = next((n for n, p in (("w13_weight", self.w13_weight), ("w2_weight", self.w2_weight))
                     if p is param), None)
        if name is None:
            raise ValueError(f"shard_id {shard_id!r} given for a parameter without expert shards")
        if (not isinstance(shard_id, tuple) or len(shard_id) != 2 or not isinstance(shard_id[0], int)
                or shard_id[1] not in EXPERT_SHARDS[name]):
            raise ValueError(f"{name} takes shard_id (expert_id, one of {EXPERT_SHARDS[name]}); got {shard_id!r}")
        expert, shard = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert_id {expert} is out of range for {self.num_experts} experts")
        rows = self.intermediate_size if name == "w13_weight" else self.hidden_size
        cols = self.hidden_size if name == "w13_weight" else self.intermediate_size
        if tuple(loaded.shape) != (rows, cols):
            raise ValueError(f"{name} shard {shard_id!r}: expected shape {(rows, cols)}, got "
                             f"{tuple(loaded.shape)}")
        slot = self._slot_of.get(expert)
        if slot is None:
            return  # held by another rank of the EP group
        inter = self.local_intermediate_size
        target = param.data[slot]  # (2I, H) or (H, I), I this rank's
        if shard == "w1":
            target = target[:inter]
        elif shard == "w3":
            target = target[inter:]
        if self.tp_size > 1:  # this rank's rows of w1 / w3, columns of w2
            loaded = take(loaded, 1 if shard == "w2" else 0, self.tp_rank * inter, inter)
        target.copy_(_materialize(loaded))

    def _load_stacked_slice(self, param: nn.Parameter, loaded) -> None:
        """A whole stacked (E, 2I, H) or (E, H, I) checkpoint tensor -> this rank's intermediate
        slice of every expert: the gate and up halves' rows separately, w2's columns."""
        intermediate, inter = self.intermediate_size, self.local_intermediate_size
        whole = (2 * intermediate, self.hidden_size) if param is self.w13_weight else (self.hidden_size, intermediate)
        if tuple(loaded.shape) != (self.num_experts, *whole):
            raise ValueError(f"weight shape mismatch: parameter {(self.num_experts, *whole)} vs checkpoint "
                             f"{tuple(loaded.shape)}")
        start = self.tp_rank * inter
        if param is self.w2_weight:
            param.data.copy_(_materialize(loaded.narrow(2, start, inter)))
            return
        param.data[:, :inter].copy_(_materialize(loaded.narrow(1, start, inter)))
        param.data[:, inter:].copy_(_materialize(loaded.narrow(1, intermediate + start, inter)))

    def quantize_experts(self, quantize: ExpertQuantizer, kernel=quantized_linear) -> None:
        """Quantize every local expert's w13 and w2 (on-the-fly --quantization; quantized_experts.py)
        and drop the float parameters; `kernel` (x, QuantizedWeight, bias) -> y runs their GEMMs."""
        if self.tp_size > 1:
            raise NotImplementedError("quantized experts split over tensor-parallel ranks are not supported; "
                                      "use --enable-expert-parallel or world size 1")
        self.set_quantized_experts([quantize(w) for w in self.w13_weight.data],
                                   [quantize(w) for w in self.w2_weight.data], kernel)

    def set_quantized_experts(self, w13: list[QuantizedWeight], w2: list[QuantizedWeight],
                              kernel=quantized_linear) -> None:
        """Run the local experts on these quantized weights (one per local expert and projection)
        through `kernel`; drops the float parameters."""
        self.expert_kernel = kernel
        self.w13_quantized = QuantizedExperts(w13)
        self.w2_quantized = QuantizedExperts(w2)
        drop_parameters(self, "w13_weight", "w2_weight")
        self._gemm_views = None

    # ---- forward ----------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """(T, H), (T, E) -> (T, H): route, dispatch, local experts, combine. Under tensor-parallel
        experts this rank's partial sum (`partial_output`): the caller all-reduces it."""
        topk_weights, topk_ids = self.route(router_logits)
        hidden_states, topk_weights, topk_ids = self.dispatch(hidden_states, topk_weights, topk_ids)
        return self.combine(self.run_experts(hidden_states, topk_weights, topk_ids))

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, E) -> topk_weights, topk_ids (T, k), global ids (E: dropped by the capacity cap);
        counts the load."""
        topk_weights, topk_ids = select_experts(
            router_logits, self.top_k, scoring_func=self.scoring_func, renormalize=self.renormalize,
            num_expert_group=self.num_expert_group, topk_group=self.topk_group, group_score=self.group_score,
            e_score_correction_bias=self.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor)
        if self.weights_in_logits_dtype:
            topk_weights = topk_weights.to(router_logits.dtype)
        if self.count_load:
            self.expert_tokens += torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
        if self.capacity_factor is not None:
            topk_weights, topk_ids, dropped = apply_capacity(topk_weights, topk_ids, self.num_experts,
                                                             self.capacity_factor)
            if self.count_load:
                self.dropped_tokens += dropped
        return topk_weights, topk_ids

    def run_experts(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' weighted sum per token; ids are local slots (E_local: skipped)."""
        if self.w13_quantized is not None and self.w2_quantized is not None:
            plans = [(self.expert_kernel, self.expert_kernel)] * self.local_num_experts
            return fused_experts(hidden_states, self.w13_quantized.experts, self.w2_quantized.experts,
                                 topk_weights, topk_ids, plans)
        if self.use_triton and hidden_states.is_cuda:
            from kvtide.layers.moe.triton_moe import triton_fused_experts

            return triton_fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if (self.expert_panels is not None and hidden_states.dtype == torch.float32
                and hidden_states.device.type == "cpu" and hidden_states.is_contiguous()):
            return fused_experts_on_panels(hidden_states, self.expert_panels, topk_weights, topk_ids)
        plans = None
        if self._gemm_views is not None and any(v.gemm_plan is not None for v in self._gemm_views):
            views = self._gemm_views
            plans = [(views[2 * e].gemm_plan, views[2 * e + 1].gemm_plan)
                     for e in range(self.local_num_experts)]
        return fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids, plans)

    def gemm_views(self) -> list[ExpertGemmView]:
        """Each local expert's w13 and w2 as the 2-D `weight` of a linear-like view, for CPU weight
        prepacking (layers/cpu_gemm.py sets each view's `gemm_plan`); [w13[0], w2[0], w13[1], ...].
        Empty once quantized: those run the quantized kernels."""
        if self.w13_quantized is not None:
            return []
        if self._gemm_views is None:
            self._gemm_views = [ExpertGemmView(w[e]) for e in range(self.local_num_experts)
                                for w in (self.w13_weight.data, self.w2_weight.data)]
        return self._gemm_views

    def use_expert_panels(self, choices: dict[str, dict[str, str]]) -> bool:
        """After cpu_gemm.prepack_weights: run the experts as one compiled call on weight panels
        (fused_experts_on_panels) when the chooser picked the panel kernel for both expert shapes at
        the rows an expert sees in a batched decode (FUSE_BUCKET), i.e. where that kernel measured
        fastest on this machine. The panels replace the per-expert plans' packed copies."""
        views = self._gemm_views
        if not views or layer_ops.layer_op("moe_experts") is None:
            return False
        if any(choices.get(shape_key(v.weight, None), {}).get(FUSE_BUCKET) != "panels" for v in views[:2]):
            return False
        self.expert_panels = (layer_ops.pack_panels(self.w13_weight.data), layer_ops.pack_panels(self.w2_weight.data))
        for view in views:
            view.gemm_plan = None
        return True

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, H), (T, k) global routing -> the rows this rank's experts compute, their weights and
        local ids. One rank holds every expert: identity. Under expert parallelism the all-to-all
        of expert_parallel.py; its bookkeeping waits on the layer for `combine`."""
        if self.dispatcher is None:
            return hidden_states, topk_weights, topk_ids
        self._dispatched = self.dispatcher.dispatch(hidden_states, topk_weights, topk_ids)
        return self._dispatched.hidden_states, self._dispatched.topk_weights, self._dispatched.topk_ids

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for dispatch's rows -> (T, H) per token, on every rank. One rank:
        identity; under expert parallelism the reverse all-to-all, the weighted sum and the gather."""
        if self.dispatcher is None:
            return partial
        dispatched, self._dispatched = self._dispatched, None
        assert dispatched is not None, "combine without a dispatch"
        return self.dispatcher.combine(partial, dispatched)

    # ---- load -------------------------------------------------------------------------------------
    def take_expert_load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert_tokens, dropped_tokens) since the last call, as copies; the counters restart at 0."""
        load = (self.expert_tokens.clone(), self.dropped_tokens.clone())
        self.expert_tokens.zero_()
        self.dropped_tokens.zero_()
        return load

    def extra_repr(self) -> str:
        ep = (f", ep_rank={self.ep_rank}/{self.ep_size}, local_experts={self.local_experts}"
              if self.ep_size > 1 else "")
        if self.tp_size > 1:
            ep += f", tp_rank={self.tp_rank}/{self.tp_size}, local_intermediate_size={self.local_intermediate_size}"
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, scoring_func={self.scoring_func}{ep}")


def _materialize(loaded) -> torch.Tensor:
    """A checkpoint tensor, read now if it is a lazy one (models/lazy_tensor.py)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()
