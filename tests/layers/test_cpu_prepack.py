"""MKL-prepacked CPU weights (kvtide/layers/cpu_prepack.py): faster, and never a different result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvtide import LLM, SamplingParams
from kvtide.engine_args import EngineArgs
from kvtide.layers import cpu_prepack
from kvtide.layers.cpu_prepack import prepack_available, prepack_weights
from kvtide.layers.embedding import LMHead
from kvtide.layers.linear import LinearBase

pytestmark = pytest.mark.skipif(not prepack_available(), reason="torch built without MKL")

ROW_COUNTS = [1, 5, 15, 16, 17, 64, 67, 200, 256, 257, 600]
"""Below, inside and above the packed window (MIN_TOKENS..MAX_TOKENS)."""


def _layers(seed: int = 0) -> nn.Module:
    """Bench-model shapes (K=768, the qkv projection with a Qwen2-style bias) and a small LM head."""
    torch.manual_seed(seed)
    model = nn.ModuleList([LinearBase(768, 1280, bias=True), LinearBase(768, 768), LinearBase(2048, 768),
                           LMHead(1000, 768)])
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return model


def _weight_bytes(model: nn.Module) -> int:
    return sum(m.weight.nbytes for m in model.modules() if hasattr(m, "prepacked"))


def test_packed_layers_give_f_linear_bits_at_every_row_count():
    model = _layers()
    packed = prepack_weights(model, "on")
    # On x86 MKL at least the K=768 shapes sum like the unpacked kernel (measured: all of them).
    assert packed >= 1
    gen = torch.Generator().manual_seed(1)
    for layer in model:
        bias = getattr(layer, "bias", None)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, layer.weight.shape[1], generator=gen)
            out = layer.logits(x) if isinstance(layer, LMHead) else layer(x)
            assert torch.equal(out, F.linear(x, layer.weight, bias)), (tuple(layer.weight.shape), rows)


def test_a_shape_whose_packed_sums_differ_keeps_f_linear(monkeypatch):
    real = cpu_prepack._packed_linear

    def off_by_rounding(x, packed, weight, bias, rows):
        return real(x, packed, weight, bias, rows) * (1 + 2**-20)

    monkeypatch.setattr(cpu_prepack, "_packed_linear", off_by_rounding)
    model = _layers()
    assert prepack_weights(model, "on") == 0
    assert all(m.prepacked is None for m in model)
    x = torch.randn(64, 768)
    assert torch.equal(model[1](x), F.linear(x, model[1].weight))


def test_auto_packs_only_when_the_copies_fit_a_quarter_of_free_memory():
    need = 4 * _weight_bytes(_layers())
    assert prepack_weights(_layers(), "auto", available_bytes=need - 4) == 0
    assert prepack_weights(_layers(), "auto", available_bytes=need) >= 1
    assert prepack_weights(_layers(), "on", available_bytes=0) >= 1
    assert prepack_weights(_layers(), "off", available_bytes=1 << 40) == 0


def test_packing_leaves_the_weights_and_state_dict_alone():
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


def test_engine_outputs_are_identical_with_and_without_packing(checkpoint_factory):
    # hidden 256: the K=256 linears are probed like any other shape; 24 decodes per step lie in
    # the packed window, and the 24 prompts prefill together (over MAX_TOKENS: unpacked).
    model_dir = checkpoint_factory("LlamaForCausalLM", hidden_size=256, intermediate_size=512,
                                   num_attention_heads=4, num_key_value_heads=2)
    prompts = [f"prompt {i}: " + "ab" * (i % 7) for i in range(24)]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    results = {}
    for mode in ("on", "off"):
        llm = LLM(model=model_dir, cpu_weight_prepack=mode, kv_cache_memory="64MiB")
        runner_model = llm.engine.core.executor.runner.model
        num_packed = sum(m.prepacked is not None for m in runner_model.modules() if hasattr(m, "prepacked"))
        results[mode] = (num_packed, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)])
    assert results["off"][0] == 0
    assert results["on"][0] >= 1
    assert results["on"][1] == results["off"][1]
