"""CPU GEMM chooser (kvtide/layers/cpu_gemm.py): every kernel it may pick is accurate, it picks only
those, measures each shape once per machine, and 'off' leaves F.linear alone."""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvtide import LLM, SamplingParams
from kvtide.engine_args import EngineArgs
from kvtide.layers import cpu_gemm, gemm_tuning
from kvtide.layers.cpu_gemm import (
    BUCKETS,
    CANDIDATES,
    F_LINEAR,
    Candidate,
    GemmPlan,
    available_candidates,
    numerics_ok,
    prepack_weights,
)
from kvtide.layers.embedding import LMHead
from kvtide.layers.linear import LinearBase

ROW_COUNTS = [1, 2, 5, 8, 9, 13, 64, 65, 100, 256, 257, 300]
"""Every bucket, at and between its edges."""


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own verdict cache, so none reads another's (or the user's) verdicts."""
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path / "cache"))


def _layers(seed: int = 0) -> nn.Module:
    """Small odd shapes, one with a bias, and an LM head: quick to measure."""
    torch.manual_seed(seed)
    model = nn.ModuleList([LinearBase(77, 131, bias=True), LinearBase(128, 96), LMHead(500, 64)])
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return model


def _fake_timing(monkeypatch, fastest: str) -> None:
    """Measured seconds without measuring: `fastest` wins every bucket it passes, F.linear is next.
    The numerics checks still run, so a busy machine must not leave a shape unmeasured."""
    monkeypatch.setattr(cpu_gemm, "MEASURE_BUDGET_S", float("inf"))
    monkeypatch.setattr(cpu_gemm, "_time_calls",
                        lambda fns: {name: 1e-6 if name == fastest else 1e-4 if name == F_LINEAR else 1e-3
                                     for name in fns})


def _assert_close_to_f_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None) -> None:
    w64 = weight.double()
    reference = x.double() @ w64.T + (0 if bias is None else bias.double())
    abs_sums = x.double().abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
    assert numerics_ok(out, reference, F.linear(x, weight, bias), abs_sums, weight.shape[1])


@pytest.mark.parametrize("name", available_candidates())
@pytest.mark.parametrize("shape", [(131, 77, True), (96, 128, False), (1280, 768, True), (33, 2048, False)])
def test_every_candidate_is_as_accurate_as_f_linear(name, shape):
    n, k, has_bias = shape
    gen = torch.Generator().manual_seed(n)
    weight = torch.randn(n, k, generator=gen) * 0.02
    bias = torch.randn(n, generator=gen) * 0.02 if has_bias else None
    candidate = CANDIDATES[name]
    packed = candidate.prepare(weight) if candidate.prepare else None
    for rows in ROW_COUNTS:
        x = torch.randn(rows, k, generator=gen)
        _assert_close_to_f_linear(candidate.run(x, weight, bias, packed, rows), x, weight, bias)


def test_the_bound_rejects_reduced_precision():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(64, 768, generator=gen), torch.randn(256, 768, generator=gen) * 0.02
    rounded = F.linear(x.bfloat16(), weight.bfloat16()).float()
    reference = x.double() @ weight.double().T
    abs_sums = x.double().abs() @ weight.double().abs().T
    assert not numerics_ok(rounded, reference, F.linear(x, weight), abs_sums, 768)
    assert not numerics_ok(F.linear(x, weight) * (1 + 2**-12), reference, F.linear(x, weight), abs_sums, 768)


def test_a_fast_candidate_that_fails_numerics_is_never_chosen(monkeypatch):
    def off_by_rounding(x, weight, bias, packed, rows):
        return F.linear(x, packed, bias) * (1 + 2**-12)

    monkeypatch.setitem(CANDIDATES, "broken", Candidate("broken", off_by_rounding, torch.clone, lambda: True))
    _fake_timing(monkeypatch, "broken")
    for mode in ("auto", "on"):
        model = _layers()
        prepack_weights(model, mode, use_cache=False)
        for choices in cpu_gemm.LAST_CHOICES.values():
            assert "broken" not in choices.values()
    weight = _layers()[0].weight
    verdicts = cpu_gemm.measure_shape(weight, None, ["f.linear", "broken"], {"broken": weight.clone()})
    assert all(times["broken"] is None and times[F_LINEAR] is not None for times in verdicts.values())


def test_a_fast_accurate_candidate_is_chosen_and_used(monkeypatch):
    calls = []

    def accurate(x, weight, bias, packed, rows):
        calls.append(rows)
        return F.linear(x, packed, bias)

    monkeypatch.setitem(CANDIDATES, "good", Candidate("good", accurate, torch.clone, lambda: True))
    _fake_timing(monkeypatch, "good")
    model = _layers()
    assert prepack_weights(model, "auto", use_cache=False) == len(model)
    for layer in model:
        assert isinstance(layer.gemm_plan, GemmPlan)
        assert set(layer.gemm_plan.choices.values()) == {"good"}
        assert set(layer.gemm_plan.packed) == {"good"}  # only the chosen kind keeps a copy
    calls.clear()
    x = torch.randn(5, 77)
    assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))
    assert calls == [5]


@pytest.mark.parametrize("kernel", [n for n in available_candidates() if CANDIDATES[n].prepare])
def test_chosen_plans_compute_f_linear_at_every_row_count(monkeypatch, kernel):
    _fake_timing(monkeypatch, kernel)
    model = _layers()
    prepack_weights(model, "on")
    assert all(set(layer.gemm_plan.choices.values()) == {kernel} for layer in model)
    gen = torch.Generator().manual_seed(1)
    for layer in model:
        bias = getattr(layer, "bias", None)
        for rows in [0, *ROW_COUNTS]:
            x = torch.randn(rows, layer.weight.shape[1], generator=gen)
            out = layer.logits(x) if isinstance(layer, LMHead) else layer(x)
            assert out.shape == (rows, layer.weight.shape[0])
            if rows:
                _assert_close_to_f_linear(out, x, layer.weight, bias)
        x3 = torch.randn(2, 3, layer.weight.shape[1], generator=gen)  # (batch, seq, K) inputs too
        out3 = layer.logits(x3) if isinstance(layer, LMHead) else layer(x3)
        assert torch.allclose(out3, F.linear(x3, layer.weight, bias), atol=1e-5)


def test_verdicts_are_cached_per_machine_and_reused(monkeypatch, tmp_path):
    _fake_timing(monkeypatch, "onednn-packed")
    before = len(cpu_gemm.MEASURED_SHAPES)
    prepack_weights(_layers(), "auto")
    assert len(cpu_gemm.MEASURED_SHAPES) - before == 3
    first = dict(cpu_gemm.LAST_CHOICES)
    files = glob.glob(os.path.join(tmp_path, "cache", "gemm", "*.json"))
    assert len(files) == 1 and "torch" in os.path.basename(files[0])

    def fail(*args):
        raise AssertionError("measured on a warm start")

    monkeypatch.setattr(cpu_gemm, "measure_shape", fail)
    prepack_weights(_layers(seed=1), "auto")  # same shapes, other weights: read from the cache
    assert cpu_gemm.LAST_CHOICES == first
    monkeypatch.undo()
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path / "cache"))
    _fake_timing(monkeypatch, "onednn-packed")
    real_info = gemm_tuning.machine_info
    monkeypatch.setattr(gemm_tuning, "machine_info", lambda: {**real_info(), "cpu_model": "Another CPU"})
    before = len(cpu_gemm.MEASURED_SHAPES)
    prepack_weights(_layers(), "auto")
    assert len(cpu_gemm.MEASURED_SHAPES) - before == 3
    assert len(glob.glob(os.path.join(tmp_path, "cache", "gemm", "*.json"))) == 2


def test_a_changed_panel_kernel_is_measured_again(monkeypatch, tmp_path):
    """Verdicts timed on one panel kernel are not kept for another (e.g. after an upgrade)."""
    _fake_timing(monkeypatch, "onednn-packed")
    prepack_weights(_layers(), "auto")
    before = len(cpu_gemm.MEASURED_SHAPES)
    edited = tmp_path / "layer_ops.cpp"
    edited.write_bytes(gemm_tuning.layer_ops.SOURCE.read_bytes() + b"\n// edited\n")
    monkeypatch.setattr(gemm_tuning.layer_ops, "SOURCE", edited)
    prepack_weights(_layers(), "auto")
    assert len(cpu_gemm.MEASURED_SHAPES) - before == 3
    assert len(glob.glob(os.path.join(tmp_path, "cache", "gemm", "*.json"))) == 2


def test_the_panel_prefetch_is_measured_once_per_machine(monkeypatch, tmp_path):
    if not CANDIDATES["panels"].available():
        pytest.skip("the panel kernel is not built here")
    measured = gemm_tuning.measure_panel_prefetch(rounds=1)  # for real: every distance timed
    assert set(measured) == set(gemm_tuning.PANEL_PREFETCH_CHOICES) and all(0 < t < 1 for t in measured.values())
    set_to = []
    monkeypatch.setattr(gemm_tuning.layer_ops, "set_panel_prefetch", set_to.append)
    monkeypatch.setattr(gemm_tuning, "measure_panel_prefetch", lambda: {0: 3e-4, 32: 1e-4, 128: 2e-4})
    _fake_timing(monkeypatch, "onednn-packed")
    prepack_weights(_layers(), "auto")
    assert set_to == [32]
    monkeypatch.setattr(gemm_tuning, "measure_panel_prefetch", lambda: pytest.fail("measured on a warm start"))
    prepack_weights(_layers(seed=1), "auto")  # read back with the shapes' verdicts
    assert set_to == [32, 32]
    assert len(gemm_tuning.load_cache(gemm_tuning.cache_path(cpu_gemm.cache_key()))) == 3


def test_another_prefetch_distance_must_win_clearly():
    assert gemm_tuning.pick_panel_prefetch({0: 254e-6, 32: 247e-6, 128: 256e-6}) == 32
    assert gemm_tuning.pick_panel_prefetch({0: 250e-6, 32: 260e-6, 128: 252e-6}) == 32  # 4% is noise here
    assert gemm_tuning.pick_panel_prefetch({0: 200e-6, 32: 240e-6, 128: 250e-6}) == 0  # a Zen 4's 17%
    assert gemm_tuning.pick_panel_prefetch({0: 3e-4, 32: 3e-4, 128: 2e-4}) == 128


def test_off_never_packs_or_measures(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "measure_shape", lambda *a: pytest.fail("measured with 'off'"))
    model = _layers()
    assert prepack_weights(model, "off", available_bytes=1 << 40) == 0
    assert all(layer.gemm_plan is None for layer in model)
    assert set(cpu_gemm.LAST_CHOICES) == {"131x77+bias", "96x128", "500x64"}
    assert all(set(c.values()) == {F_LINEAR} for c in cpu_gemm.LAST_CHOICES.values())


def test_auto_packs_only_when_the_copies_fit_a_quarter_of_free_memory(monkeypatch):
    _fake_timing(monkeypatch, "transposed")
    need = 4 * sum(m.weight.nbytes for m in _layers())
    assert prepack_weights(_layers(), "auto", available_bytes=need - 4) == 0
    assert prepack_weights(_layers(), "auto", available_bytes=need) == 3
    assert prepack_weights(_layers(), "on", available_bytes=0) == 3


def test_at_most_two_packed_kinds_per_layer():
    # Buckets 1 | 2-8 | 9-64 | 65-256 | 257+: panels win the first, mkl the second, onednn the rest.
    times = {"panels": (0.2, 0.9, 0.9, 0.9, 0.9), "mkl-packed": (0.5, 0.4, 0.9, 0.9, 0.9),
             "onednn-packed": (0.9, 0.9, 0.1, 0.1, 0.1)}
    verdicts = {b.name: {F_LINEAR: 1.0, **{k: t[i] for k, t in times.items()}} for i, b in enumerate(BUCKETS)}
    choices = cpu_gemm.choose(verdicts, "auto")
    # onednn saves 3 x 0.9, panels 0.8 (and 0.1 at 2-8 once mkl is out), mkl 0.6: mkl goes.
    assert [choices[b.name] for b in BUCKETS] == ["panels", "panels", "onednn-packed", "onednn-packed",
                                                  "onednn-packed"]
    verdicts = {b.name: {F_LINEAR: 1.0, "mkl-packed": 0.99, "onednn-packed": None} for b in BUCKETS}
    assert set(cpu_gemm.choose(verdicts, "auto").values()) == {F_LINEAR}  # within MARGIN: not worth a copy
    assert set(cpu_gemm.choose(verdicts, "on").values()) == {"mkl-packed"}


def _verdicts(panels: tuple, mkl: tuple) -> dict:
    """Seconds per call at each bucket: F.linear 1 ms, panels and mkl-packed as given (None: failed)."""
    return {b.name: {F_LINEAR: 1e-3, "panels": panels[i], "mkl-packed": mkl[i]} for i, b in enumerate(BUCKETS)}


def test_a_fusable_model_moves_to_panels_where_fusing_saves_more_than_panels_cost():
    """fusion_buckets weighs the time panels add over every fusable linear against what fusing saves
    (40 us a linear at 1-8 rows, 150 us at 9-64); choose(panels_at=...) then runs panels there."""
    mkl = (500e-6,) * 5
    slower_30us = _verdicts((530e-6, 530e-6, 650e-6, 530e-6, 530e-6), mkl)  # +30, +30, +150 us
    slower_60us = _verdicts((560e-6, 560e-6, 700e-6, 560e-6, 560e-6), mkl)  # +60, +60, +200 us
    fastest = _verdicts((400e-6,) * 5, mkl)
    verdicts = {"a": slower_30us, "b": slower_60us, "c": fastest}

    def buckets(counts: dict[str, int]) -> list[str]:
        choices = {skey: cpu_gemm.choose(verdicts[skey], "auto") for skey in counts}
        return cpu_gemm.fusion_buckets(choices, verdicts, counts)

    assert buckets({"a": 4}) == ["1", "2-8", "9-64"]
    assert buckets({"b": 4}) == []
    assert buckets({"a": 2, "b": 2}) == []  # +45 us a linear at 1-8 rows, +175 us at 9-64
    assert buckets({"b": 1, "c": 3}) == ["1", "2-8", "9-64"]  # one slow shape among fast ones: +15, +50 us
    failing = _verdicts((None, 510e-6, 510e-6, 510e-6, 510e-6), mkl)
    assert cpu_gemm.fusion_buckets({"x": cpu_gemm.choose(failing, "auto")}, {"x": failing}, {"x": 1}) == \
        ["2-8", "9-64"]

    chosen = cpu_gemm.choose(slower_60us, "auto", panels_at=["1", "2-8"])
    assert [chosen[b.name] for b in BUCKETS] == ["panels", "panels", "mkl-packed", "mkl-packed", "mkl-packed"]
    assert set(cpu_gemm.choose(slower_60us, "auto").values()) == {"mkl-packed"}
    chosen = cpu_gemm.choose(failing, "auto", panels_at=["1", "2-8"])  # panels only where they pass
    assert [chosen[b.name] for b in BUCKETS] == ["mkl-packed", "panels", "mkl-packed", "mkl-packed", "mkl-packed"]
    # kept when the kinds are trimmed to one, over a kind that saves more
    chosen = cpu_gemm.choose(slower_60us, "auto", max_kinds=1, panels_at=["1"])
    assert [chosen[b.name] for b in BUCKETS] == ["panels", "panels", "panels", "panels", "panels"]


def test_prepack_moves_every_fusable_linear_to_panels_together(monkeypatch):
    """One fusable shape's panels 30 us slower than mkl-packed at one row (past any per-shape margin),
    the other's fastest: prepack_weights gives both panels at 1-64 rows, so the layers can fuse, and
    leaves the layer outside `prefer_panels` on its fastest kernel."""
    if not CANDIDATES["panels"].available():
        pytest.skip("the panel kernel is not built here")
    model = _layers()
    slow = {cpu_gemm.shape_key(model[0].weight, model[0].bias)}

    def measure(weight, bias, names, packed):
        skey = cpu_gemm.shape_key(weight, bias)
        return {b.name: {name: {F_LINEAR: 1e-3, "mkl-packed": 100e-6,
                                "panels": 130e-6 if skey in slow else 60e-6}.get(name) for name in names}
                for b in BUCKETS}

    monkeypatch.setattr(cpu_gemm, "measure_shape", measure)
    monkeypatch.setattr(cpu_gemm, "available_candidates", lambda: [F_LINEAR, "panels", "mkl-packed"])
    prepack_weights(model, "auto", available_bytes=1 << 40, use_cache=False, prefer_panels=model[:2])
    panels, mkl = CANDIDATES["panels"].run, CANDIDATES["mkl-packed"].run
    for rows in (1, 5, 64):
        assert model[0].gemm_plan.by_rows[rows][0] is panels and model[1].gemm_plan.by_rows[rows][0] is panels
    assert model[0].gemm_plan.by_rows[65][0] is mkl
    model = _layers()
    prepack_weights(model, "auto", available_bytes=1 << 40, use_cache=False, prefer_panels=model[1:2])
    assert model[0].gemm_plan.by_rows[1][0] is mkl  # not fusable: its fastest kernel


def test_auto_counts_one_copy_per_packed_kind_and_falls_back_to_one_kind(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "measure_shape", lambda weight, bias, names, packed: {
        b.name: {name: (0.5 if (name == "panels") == (i == 0) else 1.0) if name != F_LINEAR else 1.0
                 for name in names} for i, b in enumerate(BUCKETS)})
    monkeypatch.setattr(cpu_gemm, "available_candidates", lambda: [F_LINEAR, "panels", "onednn-packed"])
    need = 4 * 2 * sum(m.weight.nbytes for m in _layers())  # two copies of every weight
    model = _layers()
    assert prepack_weights(model, "auto", available_bytes=need, use_cache=False) == 3
    assert all(set(layer.gemm_plan.packed) == {"panels", "onednn-packed"} for layer in model)
    # Room for one copy, not two: each layer keeps the kind that saves the most (onednn, 4 buckets).
    model = _layers()
    assert prepack_weights(model, "auto", available_bytes=need - 4, use_cache=False) == 3
    assert all(set(layer.gemm_plan.packed) == {"onednn-packed"} for layer in model)
    assert prepack_weights(_layers(), "auto", available_bytes=need // 2 - 4, use_cache=False) == 0


def test_packing_leaves_the_weights_and_state_dict_alone(monkeypatch):
    _fake_timing(monkeypatch, "onednn-packed")
    model = _layers()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prepack_weights(model, "on")
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bad_mode_is_refused_before_anything_loads(llama_dir):
    with pytest.raises(ValueError, match="cpu_weight_prepack must be one of auto, on, off; got 'yes'"):
        EngineArgs(model=llama_dir, cpu_weight_prepack="yes").create_engine_config(llama_dir)
    with pytest.raises(ValueError, match="cpu_weight_prepack"):
        prepack_weights(_layers(), "always")


def test_engine_outputs_agree_with_and_without_packed_kernels(checkpoint_factory, monkeypatch):
    # 'on' puts a packed kernel on every shape (numerics checked for real, timing faked to save
    # time); 16 decodes per step (bucket 9-64), the 16 prompts prefill together.
    _fake_timing(monkeypatch, "onednn-packed")
    model_dir = checkpoint_factory("LlamaForCausalLM", hidden_size=256, intermediate_size=512,
                                   num_attention_heads=4, num_key_value_heads=2)
    prompts = [f"prompt {i}: " + "ab" * (i % 7) for i in range(16)]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    results = {}
    for mode in ("on", "off"):
        llm = LLM(model=model_dir, cpu_weight_prepack=mode, kv_cache_memory="64MiB")
        runner_model = llm.engine.core.executor.runner.model
        num_planned = sum(m.gemm_plan is not None for m in runner_model.modules() if hasattr(m, "gemm_plan"))
        results[mode] = (num_planned, [o.outputs[0] for o in llm.generate(prompts, params)])
    assert results["off"][0] == 0
    assert results["on"][0] >= 1
    for on, off in zip(results["on"][1], results["off"][1], strict=True):
        assert on.token_ids == off.token_ids
        for lp_on, lp_off, token in zip(on.logprobs, off.logprobs, on.token_ids, strict=True):
            assert abs(lp_on[token].logprob - lp_off[token].logprob) < 1e-4
