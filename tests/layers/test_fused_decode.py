"""Fused decode layers (kvtide/layers/fused_decode.py, decode_layer in csrc/layer_ops.cpp): where a
step runs the decoder layers one compiled call each, its tokens and logprobs are bit-identical to the
module path's, and the fast path stands aside wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

from kvtide import LLM, SamplingParams
from kvtide.layers import cpu_gemm, fused_decode, layer_ops

pytestmark = pytest.mark.skipif(layer_ops.layer_op("decode_layer") is None, reason="no C++ compiler here")

PROMPTS = [f"prompt {i}: " + "ab" * (3 + i % 5) for i in range(5)]


@pytest.fixture(autouse=True)
def _panels_everywhere(tmp_path, monkeypatch):
    """The GEMM chooser picks the panel kernel on every shape and row count (numerics still checked;
    timing faked), so the fused path applies at every decode row count; a verdict cache of its own."""
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_gemm, "MEASURE_BUDGET_S", float("inf"))  # a busy machine still measures every shape
    monkeypatch.setattr(cpu_gemm, "_time_calls", lambda fns: {
        name: 1e-6 if name == "panels" else 1e-4 if name == cpu_gemm.F_LINEAR else 1e-3 for name in fns})


class FusedCalls(list):
    """The row count of every step the fused path ran, and (`owners`) whose layers ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: list[fused_decode.FusedDecodeLayers] = []


@pytest.fixture
def fused_rows(monkeypatch):
    rows = FusedCalls()
    run = fused_decode.FusedDecodeLayers.run

    def counted(self, cos_sin, hidden_states, *args):
        rows.append(hidden_states.shape[0])
        rows.owners.append(self)
        return run(self, cos_sin, hidden_states, *args)

    monkeypatch.setattr(fused_decode.FusedDecodeLayers, "run", counted)
    return rows


def _generate(model_dir: str, fused: bool, monkeypatch, batched: bool = True, **engine_args):
    monkeypatch.setenv("KVTIDE_FUSED_DECODE", "1" if fused else "0")
    llm = LLM(model=model_dir, cpu_weight_prepack="on", kv_cache_memory="64MiB", **engine_args)
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    if batched:
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    else:
        outputs = [llm.generate([p], params)[0].outputs[0] for p in PROMPTS[:2]]
    return llm, [(o.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.logprobs]) for o in outputs]


@pytest.mark.parametrize("architecture, config, engine_args", [
    ("LlamaForCausalLM", {}, {}),
    ("Qwen2ForCausalLM", {}, {}),  # a bias on q, k and v
    ("MistralForCausalLM", {"sliding_window": 6}, {}),  # the window cuts into every context here
    ("LlamaForCausalLM", {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 32}, {}),  # GQA 8:1
    # the runner's KV policy sets each layer's window and sinks after the model is built
    ("LlamaForCausalLM", {}, {"kv_window_tokens": 12, "kv_sink_tokens": 2}),
    # linears in quantized bytes (the weight-only kernel), with a bias
    ("LlamaForCausalLM", {}, {"quantization": "int8"}),
    ("Qwen2ForCausalLM", {"intermediate_size": 384}, {"quantization": "int4", "quantization_group_size": 32}),
    # int4 codes times activations rounded to int8
    ("LlamaForCausalLM", {"intermediate_size": 384}, {"quantization": "w4a8", "quantization_group_size": 32}),
])
@pytest.mark.parametrize("batched", [False, True])
def test_fused_steps_are_bit_identical_to_the_module_path(checkpoint_factory, monkeypatch, fused_rows,
                                                          architecture, config, engine_args, batched):
    model_dir = checkpoint_factory(architecture, **config)
    llm, fused = _generate(model_dir, True, monkeypatch, batched, **engine_args)
    assert llm.engine.core.executor.runner.model.fused_decode is not None
    # the decode steps ran fused: batch 1, or several requests together
    assert fused_rows and (max(fused_rows) > 1 if batched else set(fused_rows) == {1}), fused_rows
    steps = len(fused_rows)
    _, reference = _generate(model_dir, False, monkeypatch, batched, **engine_args)
    assert len(fused_rows) == steps  # switched off: never ran
    assert fused == reference  # tokens and top logprobs, exactly


def test_speculative_drafts_and_verification_rows_run_fused(checkpoint_factory, monkeypatch, fused_rows):
    # self-speculation at batch 1: drafts run the first 2 of 4 layers fused (1 row), the verification
    # rows hold 3 query tokens (2 drafts and the bonus position)
    model_dir = checkpoint_factory("LlamaForCausalLM")
    spec = {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 2, "adaptive": False}
    _, fused = _generate(model_dir, True, monkeypatch, batched=False, speculative_config=spec)
    assert {1, 3} <= set(fused_rows), fused_rows
    _, plain = _generate(model_dir, False, monkeypatch, batched=False)
    assert [tokens for tokens, _ in fused] == [tokens for tokens, _ in plain]
    for (_, fused_logprobs), (_, plain_logprobs) in zip(fused, plain, strict=True):
        for fused_step, plain_step in zip(fused_logprobs, plain_logprobs, strict=True):
            assert fused_step == pytest.approx(plain_step, abs=1e-4)  # verified in a batch of 3 rows


def test_a_draft_model_decodes_fused_too(checkpoint_factory, monkeypatch, fused_rows):
    model_dir = checkpoint_factory("LlamaForCausalLM")
    draft_dir = checkpoint_factory("LlamaForCausalLM", seed=0, num_hidden_layers=2)
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2, "adaptive": False}
    llm, fused = _generate(model_dir, True, monkeypatch, batched=False, speculative_config=spec)
    draft = llm.engine.core.executor.runner.spec.proposer.draft_model
    assert draft.fused_decode is not None
    assert draft.fused_decode in fused_rows.owners  # the draft's steps ran fused
    assert llm.engine.core.executor.runner.model.fused_decode in fused_rows.owners  # and the target's
    _, plain = _generate(model_dir, False, monkeypatch, batched=False)
    assert [tokens for tokens, _ in fused] == [tokens for tokens, _ in plain]


def test_panels_are_preferred_at_decode_rows_where_the_layers_can_fuse(checkpoint_factory, monkeypatch):
    """Timing faked with MKL 10% faster than panels everywhere: a Llama model's decoder linears still
    get panels at 1-64 rows (and run fused there), MKL above; its LM head (not part of a fused layer)
    and a model whose layers cannot fuse (q/k norms) keep MKL."""
    monkeypatch.setattr(cpu_gemm, "_time_calls", lambda fns: {
        name: {"panels": 1.1e-4, "mkl-packed": 1e-4, cpu_gemm.F_LINEAR: 1e-3}.get(name, 1e-2) for name in fns})
    if not cpu_gemm.CANDIDATES["mkl-packed"].available():
        pytest.skip("no MKL in this torch build")
    llm, _ = _generate(checkpoint_factory("LlamaForCausalLM"), True, monkeypatch)
    model = llm.engine.core.executor.runner.model
    rows_ok = model.fused_decode.rows_ok
    assert all(rows_ok[1:65]) and not any(rows_ok[65:])
    head = cpu_gemm.shape_key(model.lm_head.weight, None)
    layers = {k: c for k, c in cpu_gemm.LAST_CHOICES.items() if k != head}
    assert len(layers) >= 3 and {c["1"] for c in layers.values()} == {"panels"}
    assert {c["9-64"] for c in layers.values()} == {"panels"}
    assert {c["65-256"] for c in layers.values()} == {"mkl-packed"}
    assert set(cpu_gemm.LAST_CHOICES[head].values()) == {"mkl-packed"}
    llm, _ = _generate(checkpoint_factory("Qwen3ForCausalLM"), True, monkeypatch)
    assert llm.engine.core.executor.runner.model.fused_decode is None
    assert {c["1"] for c in cpu_gemm.LAST_CHOICES.values()} == {"mkl-packed"}


@pytest.mark.parametrize("architecture, engine_args, reason", [
    ("Qwen3ForCausalLM", {}, "q/k norms"),
    ("LlamaForCausalLM", {"quantization": "fp8"}, "neither the panel kernel nor the weight-only"),
])
def test_ineligible_models_keep_the_module_path(checkpoint_factory, monkeypatch, caplog, fused_rows,
                                                architecture, engine_args, reason):
    model_dir = checkpoint_factory(architecture)
    with caplog.at_level("INFO", logger="kvtide.layers.fused_decode"):
        llm, _ = _generate(model_dir, True, monkeypatch, **engine_args)
    assert llm.engine.core.executor.runner.model.fused_decode is None
    assert reason in caplog.text
    assert fused_rows == []


def test_a_quantized_kv_cache_steps_aside_per_step(checkpoint_factory, monkeypatch, fused_rows):
    model_dir = checkpoint_factory("LlamaForCausalLM")
    llm, _ = _generate(model_dir, True, monkeypatch, kv_cache_dtype="int8")
    assert llm.engine.core.executor.runner.model.fused_decode is not None
    assert fused_rows == []  # the caches are not float32: every step took the module path


def test_bad_input_is_refused_with_a_message(checkpoint_factory, monkeypatch):
    op = layer_ops.layer_op("decode_layer")
    model_dir = checkpoint_factory("LlamaForCausalLM")
    monkeypatch.setenv("KVTIDE_FUSED_DECODE", "1")
    llm = LLM(model=model_dir, cpu_weight_prepack="on", kv_cache_memory="64MiB")
    model = llm.engine.core.executor.runner.model
    weights = model.fused_decode.layer_weights[0]
    cache = model.layers[0].self_attn.attn.kv_cache
    constants = (0.125, 0, 0, model.fused_decode._attention_ns, model.fused_decode._quantized_ns)
    x = torch.zeros(1, model.config.hidden_size)
    cos = sin = torch.zeros(1, 1, cache.shape[-1] // 2)
    rows = (torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 1)
    with pytest.raises(RuntimeError, match="kv_cache must be"):
        op(x, x, True, *weights, cos, sin, cache[0], *rows, *constants)
    with pytest.raises(RuntimeError, match="panels must be float32"):
        bad = list(weights)
        bad[3] = [bad[3][0][:, :-1], *bad[3][1:]]  # qkv panels with the wrong K
        op(x, x, True, *bad, cos, sin, cache, *rows, *constants)
    with pytest.raises(RuntimeError, match="give qkv, o, gate_up and down"):
        bad = list(weights)
        bad[3] = bad[3][:3]
        op(x, x, True, *bad, cos, sin, cache, *rows, *constants)
