"""fused_experts against a per-token float64 loop (random routing, idle experts, one expert for every
token, T = 1, top_k = 1, 16-bit dtypes); FusedMoE's weight loading from per-expert tensors, its load
counters, and the capacity limit checked against counts worked out by hand; the compiled experts op
on weight panels (every ISA built here) against the same loop, and FusedMoE's switch to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvtide.layers.moe.fused_moe as fused_moe_module
from kvtide.attention import cpu_extension
from kvtide.layers import gemm_tuning, layer_ops
from kvtide.layers.cpu_gemm import shape_key
from kvtide.layers.moe import FusedMoE, apply_capacity, expert_capacity, fused_experts, select_experts
from kvtide.layers.moe.fused_moe import fused_experts_on_panels
from kvtide.layers.moe.layer import FUSE_BUCKET

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _weights(num_experts: int, hidden: int, intermediate: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) * intermediate ** -0.5
    return w13.to(dtype), w2.to(dtype)


def _reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Token by token, choice by choice, in float64; ids equal to E are skipped."""
    num_experts, two_i, _ = w13.shape
    i = two_i // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e == num_experts:
                continue
            gate_up = w13[e].double() @ x[t].double()
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ (F.silu(gate_up[:i]) * gate_up[i:]))
    return out


def _assert_matches(actual, expected, dtype):
    assert actual.dtype == dtype
    scale = expected.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=TOLERANCE[dtype] * scale)


def _random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int, idle: tuple[int, ...] = ()):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    logits[:, list(idle)] = float("-inf")
    return select_experts(logits, top_k, renormalize=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,idle", [
    (1, 8, 2, ()), (1, 4, 1, ()), (5, 8, 1, (0, 7)), (16, 8, 2, (3,)), (33, 6, 3, (1, 4)), (64, 16, 4, ()),
])
def test_fused_experts_equals_the_per_token_loop(dtype, num_tokens, num_experts, top_k, idle):
    w13, w2 = _weights(num_experts, 48, 40, seed=num_tokens, dtype=dtype)
    x = torch.randn(num_tokens, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = _random_routing(num_tokens, num_experts, top_k, seed=2, idle=idle)
    assert not set(idle) & set(ids.flatten().tolist())
    _assert_matches(fused_experts(x, w13, w2, weights, ids), _reference(x, w13, w2, weights, ids), dtype)


def test_every_token_on_one_expert():
    w13, w2 = _weights(4, 32, 24, seed=3)
    x = torch.randn(9, 32)
    ids = torch.full((9, 1), 2)
    weights = torch.rand(9, 1) + 0.5
    _assert_matches(fused_experts(x, w13, w2, weights, ids), _reference(x, w13, w2, weights, ids), torch.float32)


def _count_expert_matmuls(monkeypatch) -> list[tuple[int, tuple[int, ...]]]:
    """(rows, weight shape) of every expert matmul fused_experts runs from now on."""
    calls = []
    expert_linear = fused_moe_module.expert_linear

    def counting(x, w, stacked=None):
        calls.append((x.shape[0], tuple(w.shape)))
        return expert_linear(x, w, stacked)

    monkeypatch.setattr(fused_moe_module, "expert_linear", counting)
    return calls


def test_idle_experts_cost_nothing(monkeypatch):
    """One pair of matmuls per expert with tokens, over all of its rows; none for the others."""
    calls = _count_expert_matmuls(monkeypatch)
    w13, w2 = _weights(8, 32, 24, seed=4)
    ids = torch.tensor([[5, 1], [1, 6], [6, 5], [1, 5]])
    fused_experts(torch.randn(4, 32), w13, w2, torch.rand(4, 2), ids)
    assert [rows for rows, _ in calls] == [3, 3, 3, 3, 2, 2]  # experts 1, 5, 6: w13 then w2 each
    assert {shape for _, shape in calls} == {(48, 32), (32, 24)}


@pytest.mark.parametrize("weight_major", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 64, 300])
def test_expert_linear_is_f_linear_in_either_orientation(monkeypatch, rows, weight_major):
    """Whatever the measurement chose (forced here), the product is F.linear's up to float32 rounding."""
    class Forced(dict):
        def get(self, key, default=None):
            return weight_major

    monkeypatch.setattr(fused_moe_module, "_WEIGHT_MAJOR_WINS", Forced())
    monkeypatch.setattr(fused_moe_module, "_weight_major_is_faster", None)  # never measured here
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(40, 96, generator=g)
    out = fused_moe_module.expert_linear(x, w)
    assert out.shape == (rows, 40)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, rtol=0, atol=1e-5 * 96 ** 0.5)
    for x16 in (x.bfloat16(), x[:0]):  # not float32, or no rows: F.linear itself
        assert torch.equal(fused_moe_module.expert_linear(x16, w.to(x16.dtype)), F.linear(x16, w.to(x16.dtype)))


def test_expert_linear_measures_once_per_shape_and_bucket(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_moe_module, "_WEIGHT_MAJOR_WINS", {})
    measured = []
    is_faster = fused_moe_module._weight_major_is_faster

    def counting(stacked, rows):
        measured.append((tuple(stacked.shape[1:]), rows))
        return is_faster(stacked, rows, rounds=1)

    monkeypatch.setattr(fused_moe_module, "_weight_major_is_faster", counting)
    w = torch.randn(4, 40, 96)
    for rows in (1, 3, 4, 3, 9, 16):
        fused_moe_module.expert_linear(torch.randn(rows, 96), w[0], w)
    threads = torch.get_num_threads()
    assert set(fused_moe_module._WEIGHT_MAJOR_WINS) == {(40, 96, b, threads) for b in (1, 4, 16)}
    assert measured == [((40, 96), 1), ((40, 96), 4), ((40, 96), 16)]


def test_expert_linear_verdicts_are_kept_on_disk_per_machine(monkeypatch, tmp_path):
    """A new process (here: the in-memory verdicts dropped) reads the disk's instead of timing again,
    so ranks and restarts run the same products; another machine times its own."""
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_moe_module, "_WEIGHT_MAJOR_WINS", {})
    verdicts = {1: True, 16: False}
    measured = []

    def fake(stacked, rows):
        measured.append(rows)
        return verdicts[rows]

    monkeypatch.setattr(fused_moe_module, "_weight_major_is_faster", fake)
    w = torch.randn(4, 40, 96)
    for rows in (1, 16):
        fused_moe_module.expert_linear(torch.randn(rows, 96), w[0], w)
    assert measured == [1, 16]
    files = list((tmp_path / "gemm").glob("*.json"))
    assert len(files) == 1

    monkeypatch.setattr(fused_moe_module, "_WEIGHT_MAJOR_WINS", {})
    monkeypatch.setattr(fused_moe_module, "_weight_major_is_faster", lambda *a: pytest.fail("timed again"))
    for rows in (1, 16):
        fused_moe_module.expert_linear(torch.randn(rows, 96), w[0], w)
    threads = torch.get_num_threads()
    assert fused_moe_module._WEIGHT_MAJOR_WINS == {(40, 96, 1, threads): True, (40, 96, 16, threads): False}

    monkeypatch.setattr(fused_moe_module, "_WEIGHT_MAJOR_WINS", {})
    monkeypatch.setattr(fused_moe_module, "_weight_major_is_faster", fake)
    real_info = gemm_tuning.machine_info
    monkeypatch.setattr(gemm_tuning, "machine_info", lambda: {**real_info(), "cpu_model": "Another CPU"})
    fused_moe_module.expert_linear(torch.randn(1, 96), w[0], w)
    assert measured == [1, 16, 1] and len(list((tmp_path / "gemm").glob("*.json"))) == 2


def test_id_equal_to_num_experts_is_skipped():
    w13, w2 = _weights(4, 32, 24, seed=5)
    x = torch.randn(3, 32)
    ids = torch.tensor([[0, 4], [4, 4], [2, 1]])
    weights = torch.rand(3, 2)
    out = fused_experts(x, w13, w2, weights, ids)
    assert torch.equal(out[1], torch.zeros(32))
    _assert_matches(out, _reference(x, w13, w2, weights, ids), torch.float32)
    assert torch.equal(fused_experts(x, w13, w2, weights, torch.full((3, 2), 4)), torch.zeros(3, 32))
    assert fused_experts(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


# ---- FusedMoE: weights ------------------------------------------------------------------------
def _per_expert_tensors(num_experts: int, hidden: int, intermediate: int, seed: int) -> dict:
    """What a Mixtral checkpoint holds: experts.{e}.w1 / w3 (I, H) and w2 (H, I)."""
    g = torch.Generator().manual_seed(seed)
    return {(e, name): torch.randn(*((intermediate, hidden) if name != "w2" else (hidden, intermediate)),
                                   generator=g)
            for e in range(num_experts) for name in ("w1", "w3", "w2")}


def _loaded_moe(num_experts=4, top_k=2, hidden=32, intermediate=24, seed=6, **kwargs) -> tuple[FusedMoE, dict]:
    moe = FusedMoE(num_experts, top_k, hidden, intermediate, renormalize=True, **kwargs)
    tensors = _per_expert_tensors(num_experts, hidden, intermediate, seed)
    for (e, name), tensor in tensors.items():
        param = moe.w2_weight if name == "w2" else moe.w13_weight
        param.weight_loader(param, tensor, (e, name))
    return moe, tensors


def test_weights_load_from_per_expert_tensors():
    moe, tensors = _loaded_moe()
    assert moe.w13_weight.shape == (4, 48, 32) and moe.w2_weight.shape == (4, 32, 24)
    assert moe.w13_weight.dtype == torch.get_default_dtype() and not moe.w13_weight.requires_grad
    for e in range(4):
        assert torch.equal(moe.w13_weight[e, :24], tensors[(e, "w1")])
        assert torch.equal(moe.w13_weight[e, 24:], tensors[(e, "w3")])
        assert torch.equal(moe.w2_weight[e], tensors[(e, "w2")])
    whole = torch.randn(4, 32, 24)
    moe.w2_weight.weight_loader(moe.w2_weight, whole, None)
    assert torch.equal(moe.w2_weight.data, whole)
    assert moe.e_score_correction_bias is None
    biased = FusedMoE(4, 2, 32, 24, scoring_func="sigmoid", use_score_correction_bias=True)
    assert biased.e_score_correction_bias.dtype == torch.float32
    biased.e_score_correction_bias.weight_loader(biased.e_score_correction_bias, torch.arange(4.0), None)
    assert torch.equal(biased.e_score_correction_bias.data, torch.arange(4.0))
    assert set(dict(moe.named_parameters())) == {"w13_weight", "w2_weight"}
    assert "expert_tokens" not in moe.state_dict()  # counters are not checkpoint state


@pytest.mark.parametrize("param_name,tensor_shape,shard_id,match", [
    ("w13_weight", (24, 31), (0, "w1"), r"expected shape \(24, 32\), got \(24, 31\)"),
    ("w13_weight", (48, 32), (1, "w3"), r"expected shape \(24, 32\), got \(48, 32\)"),
    ("w2_weight", (24, 32), (2, "w2"), r"expected shape \(32, 24\), got \(24, 32\)"),
    ("w13_weight", (4, 48, 31), None, r"parameter \(4, 48, 32\) vs checkpoint \(4, 48, 31\)"),
    ("w13_weight", (24, 32), (0, "w2"), "takes shard_id"),
    ("w2_weight", (32, 24), (0, "w1"), "takes shard_id"),
    ("w2_weight", (32, 24), (4, "w2"), "out of range"),
    ("w13_weight", (24, 32), "w1", "takes shard_id"),
])
def test_bad_checkpoint_tensors_raise(param_name, tensor_shape, shard_id, match):
    moe = FusedMoE(4, 2, 32, 24)
    param = getattr(moe, param_name)
    with pytest.raises(ValueError, match=match):
        param.weight_loader(param, torch.zeros(tensor_shape), shard_id)


def test_forward_equals_the_reference_and_counts_the_load():
    moe, _ = _loaded_moe(num_experts=8, top_k=2, seed=7)
    g = torch.Generator().manual_seed(8)
    x, logits = torch.randn(12, 32, generator=g), torch.randn(12, 8, generator=g)
    # the reference routing, spelled out: softmax, top 2, renormalized
    probs = logits.softmax(dim=-1)
    ref_weights, ref_ids = probs.topk(2, dim=-1)
    ref_weights = ref_weights / ref_weights.sum(dim=-1, keepdim=True)
    out = moe(x, logits)
    _assert_matches(out, _reference(x, moe.w13_weight, moe.w2_weight, ref_weights, ref_ids), torch.float32)
    moe(x[:5], logits[:5])
    expected = torch.bincount(ref_ids.flatten(), minlength=8) + torch.bincount(ref_ids[:5].flatten(), minlength=8)
    assert moe.expert_tokens.dtype == torch.int64 and torch.equal(moe.expert_tokens, expected)
    tokens, dropped = moe.take_expert_load()
    assert torch.equal(tokens, expected) and torch.equal(dropped, torch.zeros(8, dtype=torch.int64))
    assert torch.equal(moe.expert_tokens, torch.zeros(8, dtype=torch.int64))
    assert torch.equal(tokens, expected)  # a copy, not the zeroed buffer
    moe.count_load = False
    moe(x, logits)
    assert int(moe.expert_tokens.sum()) == 0


def test_dispatch_and_combine_hooks_are_on_the_path():
    moe, _ = _loaded_moe(seed=9)
    seen = []
    moe.dispatch = lambda h, w, i: (seen.append(i.clone()), (h, w, i))[1]
    moe.combine = lambda partial: partial * 2
    x, logits = torch.randn(3, 32), torch.randn(3, 4)
    doubled = moe(x, logits)
    assert len(seen) == 1 and seen[0].shape == (3, 2)
    del moe.dispatch, moe.combine
    torch.testing.assert_close(doubled, moe(x, logits) * 2, rtol=0, atol=0)


# ---- capacity ---------------------------------------------------------------------------------
def _logits_for(choices: list[list[int]], num_experts: int) -> torch.Tensor:
    """Router logits whose top-k are exactly `choices` (first choice strongest)."""
    logits = torch.zeros(len(choices), num_experts)
    for t, row in enumerate(choices):
        for rank, e in enumerate(row):
            logits[t, e] = 6.0 - rank
    return logits


# 8 tokens, top 2 of 4 experts: 16 assignments, capacity_factor 0.5 -> ceil(0.5 * 16 / 4) = 2 each.
CHOICES = [[0, 1], [0, 2], [1, 0], [0, 3], [2, 1], [1, 0], [3, 2], [0, 1]]
# expert 0: tokens 0, 1, 2, 3, 5, 7 -> keeps 0, 1; drops 2, 3, 5, 7 (4)
# expert 1: tokens 0, 2, 4, 5, 7    -> keeps 0, 2; drops 4, 5, 7 (3)
# expert 2: tokens 1, 4, 6          -> keeps 1, 4; drops 6 (1)
# expert 3: tokens 3, 6             -> keeps both (0)
KEPT = {0: {0, 1}, 1: {0, 2}, 2: {1, 4}, 3: {3, 6}}
DROPPED = [4, 3, 1, 0]


def test_capacity_drops_the_later_tokens():
    assert expert_capacity(8, 2, 4, 0.5) == 2 and expert_capacity(3, 2, 4, 1.0) == 2
    moe, _ = _loaded_moe(capacity_factor=0.5, seed=10)
    x, logits = torch.randn(8, 32, generator=torch.Generator().manual_seed(11)), _logits_for(CHOICES, 4)
    out = moe(x, logits)
    tokens, dropped = moe.take_expert_load()
    assert dropped.tolist() == DROPPED
    assert tokens.tolist() == [6, 5, 3, 2]  # counted before the drops
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == CHOICES
    kept_weights = weights.clone()
    for t, row in enumerate(CHOICES):
        for j, e in enumerate(row):
            if t not in KEPT[e]:
                kept_weights[t, j] = 0.0  # the token skips this expert (its other choice is not renormalized)
    _assert_matches(out, _reference(x, moe.w13_weight, moe.w2_weight, kept_weights, ids), torch.float32)


def test_capacity_bounds_the_rows_each_expert_computes(monkeypatch):
    moe, _ = _loaded_moe(num_experts=8, top_k=2, capacity_factor=0.75, seed=12)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(13))
    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(14))
    logits[:, 3] += 2.0  # a popular expert, so something overflows
    capacity = expert_capacity(40, 2, 8, 0.75)
    calls = _count_expert_matmuls(monkeypatch)
    moe(x, logits)
    rows = [r for r, _ in calls]
    assert rows and max(rows) <= capacity
    tokens, dropped = moe.take_expert_load()
    assert dropped[3] > 0
    assert torch.equal(dropped, (tokens - capacity).clamp_min(0))
    assert sum(rows) // 2 == int(tokens.sum() - dropped.sum())  # every kept assignment computed once


def test_apply_capacity_as_its_docstring():
    weights, ids, dropped = apply_capacity(torch.ones(3, 2), torch.tensor([[0, 1], [0, 2], [1, 0]]), 3, 0.5)
    assert ids.tolist() == [[0, 1], [3, 2], [3, 3]]
    assert weights.tolist() == [[1, 1], [0, 1], [0, 0]]
    assert dropped.tolist() == [2, 1, 0]


def test_no_capacity_or_a_large_one_changes_nothing():
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(15))
    logits = torch.randn(10, 4, generator=torch.Generator().manual_seed(16))
    plain, _ = _loaded_moe(seed=17)
    weights, ids = select_experts(logits, 2, renormalize=True)
    direct = fused_experts(x, plain.w13_weight, plain.w2_weight, weights, ids)
    assert torch.equal(plain(x, logits), direct)
    roomy, _ = _loaded_moe(seed=17, capacity_factor=2.0)  # capacity 10: every token fits
    assert torch.equal(roomy(x, logits), direct)
    assert int(roomy.take_expert_load()[1].sum()) == 0
    with pytest.raises(ValueError, match="capacity_factor"):
        FusedMoE(4, 2, 32, 24, capacity_factor=0.0)


def test_cpu_weight_prepack_plans_the_experts():
    """--cpu-weight-prepack on: each expert's w13 and w2 get the packed kernel cpu_gemm measured
    (the views share the stacked weights' storage), and the output stays F.linear's up to rounding."""
    from kvtide.layers.cpu_gemm import available_candidates, prepack_weights

    if available_candidates() == ["f.linear", "transposed"]:
        pytest.skip("no packed GEMM kernel in this torch build")
    moe, _ = _loaded_moe(num_experts=4, hidden=64, intermediate=48)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    logits = torch.randn(9, 4, generator=torch.Generator().manual_seed(4))
    before = moe(x, logits)
    planned = prepack_weights(moe, "on", use_cache=False)
    views = moe.gemm_views()
    assert planned == len(views) == 8
    assert all(v.gemm_plan is not None for v in views)
    assert views[2].weight.data_ptr() == moe.w13_weight[1].data_ptr()
    assert views[3].weight.data_ptr() == moe.w2_weight[1].data_ptr()
    # summation order only: within float32 rounding of the products' scale (outputs cancel large terms)
    torch.testing.assert_close(moe(x, logits), before, rtol=1e-4, atol=1e-5 * before.abs().max().item())
    prepack_weights(moe, "off", use_cache=False)
    assert all(v.gemm_plan is None for v in views)


# ---- the experts in one compiled call on weight panels ---------------------------------------------
@pytest.mark.parametrize("isa", cpu_extension.available_isas())
@pytest.mark.parametrize("num_tokens,num_experts,top_k,idle,hidden,intermediate", [
    (1, 8, 2, (), 48, 40),             # decode at batch 1: one row per expert (one panel a tile)
    (13, 4, 2, (2,), 40, 24),          # a tile of 12 rows and one more; an odd number of panels
    (40, 6, 3, (0, 5), 96, 56),        # several tiles per expert, idle experts first and last
    (64, 16, 4, (), 33, 17),           # widths that are not multiples of the panel
])
def test_moe_experts_op_equals_the_per_token_loop(isa, num_tokens, num_experts, top_k, idle, hidden, intermediate):
    w13, w2 = _weights(num_experts, hidden, intermediate, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = _random_routing(num_tokens, num_experts, top_k, seed=2, idle=idle)
    ids[0, 0] = num_experts  # skipped: its token passes through the residual for that choice
    expected = _reference(x, w13, w2, weights, ids)
    op = layer_ops.layer_op("moe_experts", isa)
    order = torch.argsort(ids.reshape(-1), stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts + 1)[:num_experts]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    out = torch.full_like(x, float("nan"))
    op(out, x, order // top_k, weights.reshape(-1).index_select(0, order), offsets, layer_ops.pack_panels(w13),
       layer_ops.pack_panels(w2), intermediate)
    _assert_matches(out, expected, torch.float32)
    panels = (layer_ops.pack_panels(w13), layer_ops.pack_panels(w2))
    _assert_matches(fused_experts_on_panels(x, panels, weights, ids), expected, torch.float32)


def test_moe_experts_op_every_token_on_one_expert_and_none_routed():
    w13, w2 = _weights(4, 32, 24, seed=3)
    panels = (layer_ops.pack_panels(w13), layer_ops.pack_panels(w2))
    x = torch.randn(30, 32)
    ids, weights = torch.full((30, 1), 2), torch.rand(30, 1) + 0.5
    _assert_matches(fused_experts_on_panels(x, panels, weights, ids), _reference(x, w13, w2, weights, ids),
                    torch.float32)
    skipped = fused_experts_on_panels(x, panels, weights, torch.full((30, 1), 4))
    assert torch.equal(skipped, torch.zeros_like(x))


def test_moe_experts_op_refuses_bad_offsets():
    w13, w2 = _weights(2, 16, 16, seed=4)
    w13_panels, w2_panels = layer_ops.pack_panels(w13), layer_ops.pack_panels(w2)
    op = layer_ops.layer_op("moe_experts")
    x, weights = torch.randn(2, 16), torch.ones(3)

    def call(token_idx, offsets, w2p=w2_panels):
        op(torch.empty_like(x), x, torch.tensor(token_idx), weights, torch.tensor(offsets), w13_panels, w2p, 16)

    for offsets, match in (([0, 2, 4], "at most A"), ([0, 3, 1], "must not decrease"), ([1, 2, 3], "from 0")):
        with pytest.raises(RuntimeError, match=match):
            call([0, 0, 0], offsets)
    with pytest.raises(RuntimeError, match="token index out of range"):
        call([0, 5, 1], [0, 1, 3])
    with pytest.raises(RuntimeError, match="w2_panels must be"):
        call([0, 1, 1], [0, 1, 3], w13_panels)


def test_use_expert_panels_follows_the_gemm_choice():
    moe, _ = _loaded_moe(num_experts=8, top_k=2, seed=7)
    g = torch.Generator().manual_seed(8)
    x, logits = torch.randn(12, 32, generator=g), torch.randn(12, 8, generator=g)
    expected = moe(x, logits)
    views = moe.gemm_views()
    keys = {shape_key(v.weight, None) for v in views}
    assert keys == {"48x32", "32x24"}  # w13 (2I, H), w2 (H, I)
    other = {key: {FUSE_BUCKET: "onednn-packed"} for key in keys}
    assert not moe.use_expert_panels(other) and moe.expert_panels is None
    assert not moe.use_expert_panels({"48x32": {FUSE_BUCKET: "panels"}}) and moe.expert_panels is None
    calls = []
    original = fused_moe_module.layer_ops.moe_experts
    fused_moe_module.layer_ops.moe_experts = lambda *a: (calls.append(1), original(*a))[1]
    try:
        assert moe.use_expert_panels({key: {FUSE_BUCKET: "panels"} for key in keys})
        assert all(v.gemm_plan is None for v in views)
        out = moe(x, logits)
        strided = moe(x.t().contiguous().t(), logits)  # rows the op does not take: the torch path
    finally:
        fused_moe_module.layer_ops.moe_experts = original
    assert calls == [1]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    assert torch.equal(strided, expected)
