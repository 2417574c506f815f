"""On-the-fly weight quantization of MoE models (`--quantization int8/int4/fp8/w8a8`): every expert's
w13 and w2 are quantized with the scheme of the dense linears (layers/moe/quantized_experts.py), the
float experts are dropped, and the engine runs them through the weight-only kernels (w8a8: int8
activations times int8 weights, checked against its formula at the end).

The oracle is the float engine of the same checkpoint with every weight the quantized engine
quantized (attention, LM head, shared experts, each routed expert) overwritten by its dequantized
value: the two must give the same greedy tokens and logprobs within 1e-4 (only summation order
differs), in a batch of prompts whose prefills send more than DECODE_MAX_ROWS rows to some experts
(dequantize + GEMM) and whose decodes send a few (the quantized-bytes kernel).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_reference import LONG_PROMPT

from kvtide import LLM, SamplingParams
from kvtide.layers.moe import fused_experts
from kvtide.layers.moe.layer import FusedMoE
from kvtide.layers.quantization import weight_bytes
from kvtide.layers.quantization import weight_only as weight_only_module
from kvtide.layers.quantization.qweight import dequantize, quantize_fp8, quantize_int4, quantize_int8
from kvtide.layers.quantization.w8a8 import w8a8_expert_linear
from kvtide.layers.quantization.weight_only import quantized_linear

CASES = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96)),
    # A dense layer between sparse ones, and a shared expert (dense linears) with its sigmoid gate.
    "qwen2-moe": ("Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                              intermediate_size=256,
                                              shared_expert_intermediate_size=96, norm_topk_prob=False,
                                              mlp_only_layers=[1])),
    # MLA (kv_b_proj stays float: its weight is absorbed), a dense first layer, shared and routed
    # experts with sigmoid + correction-bias routing.
    "deepseek-v3": ("DeepseekV3ForCausalLM", dict(
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4,
        q_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        intermediate_size=256)),
}
SCHEMES = {  # name: (LLM kwargs, the quantizer of one expert's weight)
    "int8": (dict(quantization="int8"), quantize_int8),
    "int4-g32": (dict(quantization="int4", quantization_group_size=32), lambda w: quantize_int4(w, 32)),
    "fp8": (dict(quantization="fp8"), quantize_fp8),
}
PROMPTS = ["Hello", LONG_PROMPT[:150], "def add(a, b):\n    return a + b", "quantum lattice ember harbor violet"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
DECODE_MAX_ROWS = 32
"""The CPU kernel/GEMM switch for this module: the 150-token prefill sends ~75 rows to an expert
(dequantize + GEMM), the 4-row decode steps 1-4 (the quantized-bytes kernel)."""


@pytest.fixture(autouse=True, scope="module")
def _both_cpu_paths():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weight_only_module, "DECODE_MAX_ROWS", DECODE_MAX_ROWS)
        yield


def make_llm(model_dir: str, **kwargs) -> LLM:
    # cpu_weight_prepack off: the float oracle's weights are overwritten in place after loading.
    return LLM(model_dir, device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
               enable_prefix_caching=False, cpu_weight_prepack="off", **kwargs)


def model_of(llm: LLM):
    return llm.engine.core.executor.runner.model


def moe_layers(model) -> dict[str, FusedMoE]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}


@pytest.fixture(scope="module")
def moe_dir(checkpoint_factory):
    return lambda case: checkpoint_factory(CASES[case][0], **CASES[case][1])


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("case", list(CASES))
def test_experts_are_quantized_and_equal_the_float_model_of_their_values(moe_dir, case, scheme):
    kwargs, quantize = SCHEMES[scheme]
    float_llm, quant_llm = make_llm(moe_dir(case)), make_llm(moe_dir(case), **kwargs)
    float_model, quant_model = model_of(float_llm), model_of(quant_llm)
    float_moes, quant_moes = moe_layers(float_model), moe_layers(quant_model)
    assert float_moes and float_moes.keys() == quant_moes.keys()
    for name, moe in quant_moes.items():
        assert "w13_weight" not in moe._parameters and "w2_weight" not in moe._parameters, name
        assert moe.gemm_views() == []
        float_moe = float_moes[name]
        for e in range(moe.num_experts):
            for stacked, quantized in ((float_moe.w13_weight, moe.w13_quantized), (float_moe.w2_weight,
                                                                                 moe.w2_quantized)):
                assert torch.equal(dequantize(quantized.experts[e]), dequantize(quantize(stacked.data[e]))), name
                stacked.data[e] = dequantize(quantized.experts[e])  # the oracle's weights from here on
    # Every other quantized layer of the quantized model, into the float one (a tied table once).
    float_modules = dict(float_model.named_modules())
    quantized_names = [n for n, m in quant_model.named_modules() if getattr(m, "quantized", None) is not None]
    assert any(n.endswith("o_proj") for n in quantized_names) and "lm_head" in quantized_names
    if case == "deepseek-v3":  # MLA's query and latent projections quantized; kv_b_proj kept float
        assert any(n.endswith("q_a_proj") for n in quantized_names)
        assert any(n.endswith("kv_a_proj_with_mqa") for n in quantized_names)
        assert not any(n.endswith("kv_b_proj") for n in quantized_names)
    else:
        assert any(n.endswith("qkv_proj") for n in quantized_names)
    if case != "mixtral":
        assert any("shared_expert" in n for n in quantized_names)
    for name in quantized_names:
        float_modules[name].weight.data.copy_(dequantize(dict(quant_model.named_modules())[name].quantized))
    got = quant_llm.generate(PROMPTS, GREEDY)
    expected = float_llm.generate(PROMPTS, GREEDY)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        a, b = g.outputs[0], e.outputs[0]
        assert a.token_ids == b.token_ids, f"{case} {scheme} prompt {i}"
        diff = max(abs(x[t].logprob - y[t].logprob)
                   for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True))
        assert diff < 1e-4, f"{case} {scheme} prompt {i}: logprobs differ by {diff:.2e}"


def test_quantized_experts_take_their_quantized_size(moe_dir):
    """Mixtral's 4 experts per layer hold 2I x H + H x I = 3 x 96 x 128 codes each; int8 keeps one
    byte per code and a float32 scale per output row (2I + H rows), against 4 bytes per weight."""
    float_llm, int8_llm = make_llm(moe_dir("mixtral")), make_llm(moe_dir("mixtral"), quantization="int8")
    experts, hidden, inter = 4, 128, 96
    expected = experts * (3 * inter * hidden + 4 * (2 * inter + hidden))
    for moe in moe_layers(model_of(int8_llm)).values():
        held = sum(b.nbytes for q in (moe.w13_quantized, moe.w2_quantized) for b in q.buffers())
        assert held == expected
    num_layers = len(moe_layers(model_of(int8_llm)))
    saved = weight_bytes(model_of(float_llm)) - weight_bytes(model_of(int8_llm))
    # The experts alone save 4 bytes per weight less what int8 keeps; the other linears save more.
    assert saved > num_layers * (experts * 3 * inter * hidden * 4 - expected)
    assert int8_llm.engine.core.executor.runner.weight_bytes == weight_bytes(model_of(int8_llm))


def test_int4_groups_must_divide_the_experts_width(checkpoint_factory):
    model_dir = checkpoint_factory("Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=48, intermediate_size=256,
                                   shared_expert_intermediate_size=96)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        make_llm(model_dir, quantization="int4", quantization_group_size=32)


def test_w8a8_experts_multiply_int8_activations_by_int8_weights(moe_dir):
    """Under w8a8 each expert holds the int8 per-channel weights of int8 weight-only (the same codes
    and scales) and rounds its input rows to int8 per token, for w13 and again for w2's input: the
    layer equals that formula worked in float64, and differs from weight-only int8 by the rounding."""
    float_llm, w8a8_llm = make_llm(moe_dir("mixtral")), make_llm(moe_dir("mixtral"), quantization="w8a8")
    float_moes, w8a8_moes = moe_layers(model_of(float_llm)), moe_layers(model_of(w8a8_llm))
    gen = torch.Generator().manual_seed(3)
    for name, moe in w8a8_moes.items():
        float_moe = float_moes[name]
        assert moe.expert_kernel is w8a8_expert_linear and "w13_weight" not in moe._parameters
        parts = {}
        for e in range(moe.num_experts):
            for key, stacked, quantized in (("w13", float_moe.w13_weight, moe.w13_quantized),
                                            ("w2", float_moe.w2_weight, moe.w2_quantized)):
                expected = quantize_int8(stacked.data[e])
                assert torch.equal(quantized.experts[e].codes, expected.codes), (name, e, key)
                assert torch.equal(quantized.experts[e].scales, expected.scales), (name, e, key)
                parts[key, e] = (expected.codes.double(), expected.scales.double().reshape(1, -1))
        x = torch.randn(9, moe.hidden_size, generator=gen)
        weights, ids = torch.rand(9, 2, generator=gen), torch.stack([torch.arange(9) % 4, (torch.arange(9) + 1) % 4], 1)
        with torch.inference_mode():
            got = moe.run_experts(x, weights, ids).double()
            weight_only = fused_experts(x, moe.w13_quantized.experts, moe.w2_quantized.experts, weights, ids,
                                        [(quantized_linear, quantized_linear)] * moe.num_experts).double()

        def int8_rows(v):  # per-token int8 activations, as the layer rounds them (float32)
            scale = v.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
            return torch.round(v / scale).clamp(-128, 127).double(), scale.double()

        expected = torch.zeros(9, moe.hidden_size, dtype=torch.float64)
        inter = moe.local_intermediate_size
        for t in range(9):
            for j in range(2):
                e = int(ids[t, j])
                codes, scale = int8_rows(x[t:t + 1])
                gate_up = (codes @ parts["w13", e][0].T) * scale * parts["w13", e][1]
                act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).float()
                codes, scale = int8_rows(act)
                expected[t] += float(weights[t, j]) * ((codes @ parts["w2", e][0].T) * scale * parts["w2", e][1])[0]
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() < 1e-4 * scale, name
        assert (got - weight_only).abs().max().item() > 1e-3 * scale, name  # activations rounded, not float
    assert w8a8_llm.generate(PROMPTS[:2], GREEDY)[0].outputs[0].token_ids  # the engine serves them
