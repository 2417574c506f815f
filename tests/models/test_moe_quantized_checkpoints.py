"""GPTQ and AWQ checkpoints of MoE models: every expert's w1 / w3 / w2 stored as packed-integer
tensors of its own (`experts.{e}.w1.qweight`, ...), as Mixtral- and Qwen-MoE-GPTQ/AWQ exports hold them. The checkpoint is
written here from a tiny seeded HF checkpoint (routers and embeddings float, as those exports keep
them) beside its dequantized float twin; kvtide must decode both alike (greedy tokens equal,
logprobs within 1e-4: the weights are the same, only summation order differs), hold the experts
quantized, and refuse what it cannot run with the tensor named."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quantized_checkpoints import (
    LOGPROB_TOL,
    assert_same_decoding,
    awq_encoder,
    gptq_config,
    gptq_encoder,
    make_llm,
    runner_model,
    write_checkpoints,
)

from kvtide.layers.moe.layer import FusedMoE
from kvtide.layers.quantization import weight_bytes

CASES = {
    "mixtral": ("MixtralForCausalLM", dict(seed=4, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                           num_local_experts=4, num_experts_per_tok=2)),
    # Shared expert (a dense, GPTQ-quantized MLP) with its sigmoid gate; experts named gate/up/down_proj.
    "qwen2-moe": ("Qwen2MoeForCausalLM", dict(seed=4, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                              shared_expert_intermediate_size=96)),
}
VARIANTS = {  # name: (bits, group_size, sym, v1 format, act-order) of GPTQ, or AWQ's group size
    "4bit-g32": (4, 32, True, True, False),
    "8bit-asym-per-channel-v2": (8, -1, False, False, False),
    "4bit-g32-act-order": (4, 32, False, True, True),
    "awq-g32": 32,
    "4bit-g16": (4, 16, True, True, False),  # groups that split over 2 ranks (48 columns each)
}
DECODED = ["4bit-g32", "8bit-asym-per-channel-v2", "4bit-g32-act-order", "awq-g32"]


def _format(variant: str):
    """(quantization_config, encoder) of a variant."""
    if variant.startswith("awq"):
        group = VARIANTS[variant]
        return ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
                awq_encoder(group))
    bits, group, sym, v1, act_order = VARIANTS[variant]
    return (gptq_config(bits, group, sym, desc_act=act_order, fmt="gptq" if v1 else "gptq_v2"),
            gptq_encoder(bits, group, sym, v1, act_order=act_order))


def _encoder(encode):
    def encode_all_but_routers(module: str, w: torch.Tensor):
        leaf = module.rsplit(".", 1)[-1]
        return None if leaf in ("gate", "shared_expert_gate") else encode(module, w)

    return encode_all_but_routers


@pytest.fixture(scope="module")
def quantized_moe(checkpoint_factory, tmp_path_factory):
    made: dict[tuple[str, str], tuple[str, str]] = {}

    def make(case: str, variant: str) -> tuple[str, str]:
        if (case, variant) not in made:
            architecture, config = CASES[case]
            quant_config, encode = _format(variant)
            made[case, variant] = write_checkpoints(
                checkpoint_factory(architecture, **config), str(tmp_path_factory.mktemp(f"{case}-{variant}")),
                quant_config, _encoder(encode))
        return made[case, variant]

    return make


def _moe_layers(llm) -> list[FusedMoE]:
    return [m for m in runner_model(llm).modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("case,variant", [("mixtral", v) for v in DECODED] + [("qwen2-moe", "4bit-g32")])
def test_experts_decode_like_their_dequantized_weights(quantized_moe, case, variant):
    quant_dir, float_dir = quantized_moe(case, variant)
    keys = load_file(os.path.join(quant_dir, "model.safetensors")).keys()
    assert any(".experts.0." in k and k.endswith(".qweight") for k in keys)  # per-expert GPTQ tensors
    quant, dequantized = make_llm(quant_dir), make_llm(float_dir)
    moes = _moe_layers(quant)
    assert moes and all(m.w13_quantized is not None and "w13_weight" not in m._parameters for m in moes)
    assert not any(name.startswith(("w13_q", "w2_q")) for m in moes for name in m._parameters)  # converted, dropped
    bits, act_order = (4, False) if variant.startswith("awq") else (VARIANTS[variant][0], VARIANTS[variant][4])
    first = moes[0].w13_quantized.experts[0]
    assert first.kind == ("int4" if bits == 4 else "int8")
    assert (first.input_perm is not None) == act_order
    assert weight_bytes(runner_model(quant)) < weight_bytes(runner_model(dequantized)) / 2
    assert_same_decoding(quant, dequantized, LOGPROB_TOL)


def _edit(quant_dir: str, tmp_path, **tensors: torch.Tensor) -> str:
    import shutil

    path = shutil.copytree(quant_dir, str(tmp_path / "edited"))
    state = load_file(os.path.join(path, "model.safetensors"))
    state.update(tensors)
    save_file(state, os.path.join(path, "model.safetensors"))
    return path


def test_expert_tensors_of_the_wrong_shape_name_the_expert(quantized_moe, tmp_path):
    quant_dir, _ = quantized_moe("mixtral", "4bit-g32")
    name = "model.layers.1.block_sparse_moe.experts.2.w3.qweight"
    wrong = torch.zeros(128 // 8, 64, dtype=torch.int32)  # 64 outputs where the expert has 96
    path = _edit(quant_dir, tmp_path, **{name: wrong})
    with pytest.raises(ValueError, match=r"experts\.2\.w3\.qweight has shape \(16, 64\), expected \(16, 96\)"):
        make_llm(path)


def test_act_order_w1_and_w3_must_share_g_idx(quantized_moe, tmp_path):
    quant_dir, _ = quantized_moe("mixtral", "4bit-g32-act-order")
    name = "model.layers.0.block_sparse_moe.experts.1.w3.g_idx"
    g_idx = load_file(os.path.join(quant_dir, "model.safetensors"))[name]
    path = _edit(quant_dir, tmp_path, **{name: g_idx.flip(0).contiguous()})
    with pytest.raises(ValueError, match=r"experts\.1\.w13: w1 and w3 carry different g_idx"):
        make_llm(path)


def test_a_missing_expert_tensor_is_named(quantized_moe, tmp_path):
    quant_dir, _ = quantized_moe("mixtral", "4bit-g32")
    import shutil

    path = shutil.copytree(quant_dir, str(tmp_path / "missing"))
    state = load_file(os.path.join(path, "model.safetensors"))
    del state["model.layers.0.block_sparse_moe.experts.3.w2.scales"]
    save_file(state, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights for: .*experts\.w2_scales"):
        make_llm(path)


def test_tensor_parallel_gptq_experts_are_refused(quantized_moe):
    quant_dir, _ = quantized_moe("mixtral", "4bit-g16")
    with open(os.path.join(quant_dir, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "gptq"
    with pytest.raises(ValueError, match="gptq.* of experts split over tensor-parallel ranks is not supported"):
        make_llm(quant_dir, tensor_parallel_size=2, distributed_executor_backend="mp")
