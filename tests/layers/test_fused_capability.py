"""The CPU fast paths ask a model and its layers what they compute (`fused_decode_layers()`,
`fused_decode_plan()`, `cuda_graph_unsupported()`) instead of checking their types: a subclassed
or renamed Llama decoder layer still runs as one compiled call per decode step, with the module
path's tokens and logprobs bit for bit; a layer that computes something else takes the module path
and says why in the log once, however many steps run."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvtide import LLM, SamplingParams
from kvtide.attention.cpu_extension import load_paged_attention
from kvtide.layers import cpu_gemm, cpu_ops, fused_decode, layer_ops
from kvtide.layers.norm import RMSNorm
from kvtide.models.llama import LlamaDecoderLayer, LlamaMLP
from kvtide.worker import cpu_kernels
from kvtide.worker.cuda_graph import maybe_capture_decode_graphs

needs_compiler = pytest.mark.skipif(layer_ops.layer_op("decode_layer") is None, reason="no C++ compiler here")

PROMPTS = [f"prompt {i}: " + "ab" * (3 + i) for i in range(3)]
LOGGER = "kvtide.layers.fused_decode"


class SubclassedLayer(LlamaDecoderLayer):
    """A model's own decoder layer: something added, the computation left alone."""

    def describe(self) -> str:
        return "a Llama layer with a method of its own"


RenamedLayer = type("RenamedLayer", (nn.Module,),
                    {name: value for name, value in vars(LlamaDecoderLayer).items()
                     if name not in ("__dict__", "__weakref__")})
"""A copy of LlamaDecoderLayer under another name, not a subclass of it."""


class UngatedMLP(LlamaMLP):
    """silu(gate) without the up projection's product: not what the fused kernel computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_up_proj(x)[..., :self.down_proj.input_size_per_partition]
        return self.down_proj(F.silu(gate))


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory) -> str:
    """One cache for this module's engines: the faked verdicts below are the same for all of them.
    The attention kernels load first from the usual cache (once a process), not rebuilt in this one."""
    load_paged_attention()
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(autouse=True)
def _panels_everywhere(module_cache, monkeypatch):
    """The GEMM chooser picks the panel kernel everywhere (timing faked, numerics still checked),
    so the fused path applies at every decode row count; a verdict cache of this module's own."""
    monkeypatch.setenv("KVTIDE_CACHE", module_cache)
    monkeypatch.setattr(cpu_gemm, "MEASURE_BUDGET_S", float("inf"))
    monkeypatch.setattr(cpu_gemm, "_time_calls", lambda fns: {
        name: 1e-6 if name == "panels" else 1e-4 if name == cpu_gemm.F_LINEAR else 1e-3 for name in fns})


@pytest.fixture
def fused_calls(monkeypatch) -> list[fused_decode.FusedDecodeLayers]:
    """Whose FusedDecodeLayers ran each fused step (the compiled decode_layer calls)."""
    owners: list[fused_decode.FusedDecodeLayers] = []
    run = fused_decode.FusedDecodeLayers.run

    def counted(self, *args):
        owners.append(self)
        return run(self, *args)

    monkeypatch.setattr(fused_decode.FusedDecodeLayers, "run", counted)
    return owners


@pytest.fixture(scope="module")
def module_path_outputs() -> dict[str, list]:
    """model directory -> its outputs on the module path (the reference), computed once."""
    return {}


def _reshape_layers(monkeypatch, layer_class: type | None = None, mlp_class: type | None = None) -> None:
    """Give every decoder layer (and its MLP) of the models loaded from here on another class, as a
    model file of its own would, before the CPU kernels are applied."""
    use_cpu_ops = cpu_kernels.use_cpu_ops

    def reshaped(model: nn.Module) -> int:
        for layer in model.layers:
            if layer_class is not None:
                layer.__class__ = layer_class
            if mlp_class is not None:
                layer.mlp.__class__ = mlp_class
        return use_cpu_ops(model)

    monkeypatch.setattr(cpu_kernels, "use_cpu_ops", reshaped)


def _generate(model_dir: str, fused: bool, monkeypatch, **engine_args):
    monkeypatch.setenv("KVTIDE_FUSED_DECODE", "1" if fused else "0")
    llm = LLM(model=model_dir, cpu_weight_prepack="on", kv_cache_memory="64MiB", **engine_args)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return (llm.engine.core.executor.runner.model,
            [(o.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.logprobs]) for o in outputs])


@needs_compiler
@pytest.mark.parametrize("layer_class", [SubclassedLayer, RenamedLayer])
def test_a_subclassed_or_renamed_llama_layer_runs_fused(checkpoint_factory, monkeypatch, fused_calls,
                                                        module_path_outputs, layer_class):
    model_dir = checkpoint_factory("LlamaForCausalLM")
    if model_dir not in module_path_outputs:
        _, module_path_outputs[model_dir] = _generate(model_dir, False, monkeypatch)
        assert fused_calls == []  # switched off: the module path only
    _reshape_layers(monkeypatch, layer_class)
    model, fused = _generate(model_dir, True, monkeypatch)
    assert {type(layer) for layer in model.layers} == {layer_class}
    assert model.fused_decode is not None and fused_calls and set(fused_calls) == {model.fused_decode}
    assert fused == module_path_outputs[model_dir]  # tokens and top logprobs, exactly


@needs_compiler
@pytest.mark.parametrize("architecture, mlp_class, reason", [
    ("Qwen3ForCausalLM", None, "attention with q/k norms"),
    ("LlamaForCausalLM", UngatedMLP, "UngatedMLP changes the gated MLP's forward"),
])
def test_an_ineligible_layer_takes_the_module_path_and_says_why_once(checkpoint_factory, monkeypatch, caplog,
                                                                     fused_calls, architecture, mlp_class, reason):
    model_dir = checkpoint_factory(architecture)
    _reshape_layers(monkeypatch, mlp_class=mlp_class)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model, outputs = _generate(model_dir, True, monkeypatch)
    assert model.fused_decode is None and fused_calls == []
    assert sum(len(tokens) for tokens, _ in outputs) == 8 * len(PROMPTS)  # several decode steps ran
    said = [r for r in caplog.records if r.name == LOGGER and reason in r.getMessage()]
    assert len(said) == 1 and said[0].levelno >= logging.INFO, caplog.text


@needs_compiler
def test_a_cache_off_the_float_kernels_says_why_once_over_its_steps(checkpoint_factory, monkeypatch, caplog,
                                                                     fused_calls):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model, _ = _generate(checkpoint_factory("LlamaForCausalLM"), True, monkeypatch, kv_cache_dtype="int8")
    assert model.fused_decode is not None and fused_calls == []  # eligible layers, an int8 cache each step
    said = [r for r in caplog.records if r.name == LOGGER and "steps take the module path" in r.getMessage()]
    assert len(said) == 1 and "compiled float kernels" in said[0].getMessage(), caplog.text


class ModelNorm(RMSNorm):
    """A model's own RMSNorm subclass that keeps its computation."""

    label = "model norm"


class ScaledNorm(RMSNorm):
    """One that computes something else (its forward is its own)."""

    def forward(self, x, residual=None):
        return super().forward(x * 2, residual)


@pytest.mark.skipif(not layer_ops.available(), reason="no C++ compiler here")
def test_use_cpu_ops_swaps_subclasses_that_keep_the_computation():
    block = nn.Module()
    block.kept, block.own = ModelNorm(32, 1e-5), ScaledNorm(32, 1e-5)
    torch.nn.init.normal_(block.kept.weight)
    x = torch.randn(3, 32)
    expected = block.kept(x)
    assert not cpu_ops.runs_compiled_ops(block.kept, RMSNorm)
    assert cpu_ops.use_cpu_ops(block) == 1
    assert isinstance(block.kept, ModelNorm) and block.kept.label == "model norm"
    assert cpu_ops.runs_compiled_ops(block.kept, RMSNorm)
    torch.testing.assert_close(block.kept(x), expected, rtol=1e-6, atol=1e-6)
    assert type(block.own) is ScaledNorm and not cpu_ops.runs_compiled_ops(block.own, RMSNorm)
    assert cpu_ops.use_cpu_ops(block) == 0  # nothing left to swap


class _HostReadingModel(nn.Module):
    def cuda_graph_unsupported(self) -> str | None:
        return "its attention reads per-step host lists"


def test_cuda_graphs_ask_the_model_and_say_why_not(llama_dir, caplog):
    from kvtide.engine_args import EngineArgs

    config = EngineArgs(model=llama_dir, max_model_len=64).create_engine_config(llama_dir)
    cuda_config = dataclasses.replace(config, device_config=dataclasses.replace(
        config.device_config, device="cuda", attention_backend="triton", enforce_eager=False))
    with caplog.at_level(logging.INFO, logger="kvtide.worker.cuda_graph"):
        assert maybe_capture_decode_graphs(_HostReadingModel(), cuda_config, torch.device("cuda")) is None
    assert "its attention reads per-step host lists" in caplog.text


def test_a_soft_capped_attention_says_why_it_is_not_fused():
    """A Llama attention built with a logit soft cap computes what the fused kernel does not."""
    from types import SimpleNamespace

    from kvtide.layers.rotary import RotaryEmbedding
    from kvtide.models.llama import LlamaAttention

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=16,
                             rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128)
    rotary = RotaryEmbedding(config, 16, 128, torch.float32)
    plain = LlamaAttention(config, 0, 128, torch.float32, False, False, False, rotary)
    capped = LlamaAttention(config, 0, 128, torch.float32, False, False, False, rotary, logits_soft_cap=30.0)
    assert not isinstance(plain.fused_decode_attention(), str)
    assert capped.fused_decode_attention() == "attention logit soft-capping"
