"""MoE and MLA decoders against Hugging Face `generate` in float32: Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2 and DeepSeek-V3 on tiny seeded checkpoints (peaked logits and router scores, so no
routing near-ties), greedy tokens equal and logprobs within 1e-4, through the engine paths that
move K/V: batches of 1, 3 and 16, chunked prefill over a cached prefix, preemption by recompute,
a warm prefix cache. Plus the latent cache's size, the MTP layer skipped at load, and the expert
load reported per layer equal to the routing of a reference forward pass.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_reference import LONG_PROMPT, hf_greedy, hf_model_and_tokenizer, hf_prompt_ids
from safetensors.torch import load_file, save_file
from test_hf_parity import (
    BATCHES,
    GREEDY,
    GREEDY_LOGPROBS,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    assert_greedy_matches_hf,
    assert_logprobs_match_hf,
    assert_prompt_logprobs_match_hf,
    make_llm,
)

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)
DEEPSEEK_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=4, topk_group=2)
MOE_CASES = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96)),
    # Layer 1 dense (mlp_only_layers) between sparse ones; shared expert with its sigmoid gate.
    "qwen2-moe": ("Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                              shared_expert_intermediate_size=96, norm_topk_prob=False,
                                              mlp_only_layers=[1])),
    # Every second layer sparse (decoder_sparse_step 2), renormalized top-k, q/k norm.
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                              norm_topk_prob=True, decoder_sparse_step=2, head_dim=32)),
    # No q LoRA, group-limited greedy softmax routing, scaled weights.
    "deepseek-v2": ("DeepseekV2ForCausalLM", dict(**MLA, **DEEPSEEK_MOE, q_lora_rank=None,
                                                  topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
    # q LoRA, sigmoid + correction-bias (noaux_tc) routing, YaRN with its attention-scale correction.
    "deepseek-v3": ("DeepseekV3ForCausalLM", dict(**MLA, **DEEPSEEK_MOE, q_lora_rank=48, norm_topk_prob=True,
                                                  routed_scaling_factor=2.5, max_position_embeddings=512,
                                                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 128,
                                                                "mscale": 1.0, "mscale_all_dim": 1.0})),
}
MOE_LOGPROB_TOL = 2e-4
"""The MoE models' logprobs against HF (1e-4 for dense ones). The top-k routing weights scale each
expert's output and the experts' sum adds their GEMMs' summation-order noise: on a Zen 4 EPYC the
tiny Mixtral's chosen-token logprob reached 1.0025e-4 from HF's (step 14 of 24) with the GEMM kernels
that machine's load-time measurement picks; its prompt logprobs 1.72e-4 with them and 6.5e-5 with
--cpu-weight-prepack off (F.linear, as HF). Tokens stay equal."""
ENGINE_CASES = ["mixtral", "deepseek-v3"]
"""The engine paths on one GQA MoE model and one MLA model."""


def randomize_correction_bias(model_dir: str, seed: int = 0) -> None:
    """transformers initializes DeepSeek-V3's e_score_correction_bias to zeros; give it values that
    change which experts win, so the test sees whether the bias is applied (and only to choosing)."""
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = (torch.rand(tensor.shape, generator=gen) - 0.5) * 0.4
    save_file(tensors, path, metadata={"format": "pt"})


def moe_case_dir(checkpoint_factory, case: str) -> str:
    """MOE_CASES[case] built (DeepSeek-V3's correction bias randomized once, so routing depends on it)."""
    architecture, overrides = MOE_CASES[case]
    model_dir = checkpoint_factory(architecture, **overrides)
    if architecture == "DeepseekV3ForCausalLM" and not os.path.exists(os.path.join(model_dir, ".bias")):
        randomize_correction_bias(model_dir)
        open(os.path.join(model_dir, ".bias"), "w").close()
    return model_dir


@pytest.fixture(scope="module")
def moe_dir(checkpoint_factory):
    return lambda case: moe_case_dir(checkpoint_factory, case)


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_architecture_matches_hf(moe_dir, case):
    model_dir = moe_dir(case)
    llm = make_llm(model_dir, kv_cache_memory="8MiB", max_num_batched_tokens=48)
    for size in (1, 3):  # 48-token chunks: the long prompt is prefilled over a cached prefix
        prompts = BATCHES[size]
        outputs = llm.generate(prompts, GREEDY_LOGPROBS)
        assert_greedy_matches_hf(model_dir, prompts, outputs)
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            assert_logprobs_match_hf(hf_greedy(model_dir, prompt, MAX_TOKENS), out, f"{case} prompt {i}",
                                     MOE_LOGPROB_TOL)
            assert_prompt_logprobs_match_hf(model_dir, out, f"{case} prompt {i}", MOE_LOGPROB_TOL)


def test_correction_bias_changes_the_routing(moe_dir):
    """Guard for the DeepSeek-V3 case: HF's continuation with the randomized bias differs from the
    same weights with a zero bias, so matching HF really checks that the bias is applied."""
    model_dir = moe_dir("deepseek-v3")
    model, _ = hf_model_and_tokenizer(model_dir)
    ids = torch.tensor([hf_prompt_ids(model_dir, PROMPTS[2])])
    with torch.inference_mode():
        biased = model(ids).logits
        saved = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
        assert saved and all(b.abs().max() > 0.05 for b in saved.values())
        for name in saved:
            model.get_buffer(name).zero_()
        try:
            unbiased = model(ids).logits
        finally:
            for name, value in saved.items():
                model.get_buffer(name).copy_(value)
    assert (biased.argmax(-1) != unbiased.argmax(-1)).any()


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_moe_preemption_and_chunks_match_hf(moe_dir, case):
    """16 prompts at once in a pool that forces preemption, in 13-token chunks."""
    model_dir = moe_dir(case)
    probe = make_llm(model_dir, kv_cache_memory="1MiB")
    block_bytes = probe.engine.core.executor.kv_bytes_per_block()
    num_blocks = -(-MAX_MODEL_LEN // 16) + 3
    llm = make_llm(model_dir, kv_cache_memory=str(num_blocks * block_bytes), enable_prefix_caching=True,
                   max_num_batched_tokens=13)
    outputs = llm.generate(PROMPTS, GREEDY)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert_greedy_matches_hf(model_dir, PROMPTS, outputs)
    scheduler.kv_cache_manager.pool.check_integrity()
    assert scheduler.kv_cache_manager.pool.num_used_blocks == 0


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_moe_warm_prefix_cache_matches_hf(moe_dir, case):
    """The same 16 prompts again over the prefix cache they filled: the long prompt's blocks are hits."""
    model_dir = moe_dir(case)
    llm = make_llm(model_dir, enable_prefix_caching=True, max_num_batched_tokens=64)
    assert_greedy_matches_hf(model_dir, PROMPTS, llm.generate(PROMPTS, GREEDY))
    warm = llm.generate(PROMPTS, GREEDY)
    assert_greedy_matches_hf(model_dir, PROMPTS, warm)
    assert warm[PROMPTS.index(LONG_PROMPT)].num_cached_tokens >= 320


def test_latent_cache_bytes_per_token(moe_dir, checkpoint_factory):
    """MLA caches one (kv_lora_rank + qk_rope_head_dim) vector per token and layer, not H heads of
    K and V: here 40 floats against 4 x (24 + 16) = 160."""
    llm = make_llm(moe_dir("deepseek-v3"), kv_cache_memory="1MiB")
    block_bytes = llm.engine.core.executor.kv_bytes_per_block()
    layers = 4
    assert block_bytes == 16 * layers * (32 + 8) * 4
    expanded = 16 * layers * 4 * ((16 + 8) + 16) * 4
    assert expanded / block_bytes == 4.0


def test_mtp_layer_is_skipped_at_load(moe_dir, tmp_path):
    """A DeepSeek-V3 checkpoint's multi-token-prediction layer (layers.{num_hidden_layers}.*) loads
    cleanly: recognised, not loaded, not an error, and the outputs are unchanged."""
    source = moe_dir("deepseek-v3")
    target = str(tmp_path / "with-mtp")
    shutil.copytree(source, target)
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    extra = {f"model.layers.{n}.eh_proj.weight": torch.zeros(hidden, 2 * hidden),
             f"model.layers.{n}.enorm.weight": torch.ones(hidden),
             f"model.layers.{n}.hnorm.weight": torch.ones(hidden),
             f"model.layers.{n}.shared_head.norm.weight": torch.ones(hidden),
             f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.zeros(48, hidden)}
    save_file(extra, os.path.join(target, "model-mtp.safetensors"), metadata={"format": "pt"})
    llm = make_llm(target)
    model = llm.engine.core.executor.runner.model
    assert model.mtp_tensors_skipped == len(extra)
    out = llm.generate([PROMPTS[3]], GREEDY)
    assert out[0].outputs[0].token_ids == hf_greedy(source, PROMPTS[3], MAX_TOKENS).token_ids


def _hf_routing(model_dir: str, prompt_ids: list[int]) -> dict[int, torch.Tensor]:
    """Per sparse layer, the experts HF's own router picks for each prompt token (T, k)."""
    model, _ = hf_model_and_tokenizer(model_dir)
    picked: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue

        def hook(module, args, output, i=i):
            picked[i] = output[2] if isinstance(output, tuple) else output
        hooks.append(gate.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            model(torch.tensor([prompt_ids]))
    finally:
        for h in hooks:
            h.remove()
    return picked


@pytest.mark.parametrize("case", ["qwen2-moe", "deepseek-v3"])
def test_expert_load_counts_equal_reference_routing(moe_dir, case):
    """The counts the engine reports per (layer, expert) for a prompt's prefill equal the experts HF's
    routers choose for the same tokens."""
    model_dir = moe_dir(case)
    llm = make_llm(model_dir)
    prompt_ids = hf_prompt_ids(model_dir, PROMPTS[2])
    llm.generate([{"prompt_token_ids": prompt_ids}], GREEDY.clone(max_tokens=1))
    load = llm.engine.core.get_stats().expert_load
    assert load is not None
    reference = _hf_routing(model_dir, prompt_ids)
    assert sorted(reference) == load["layers"]
    for row, layer in enumerate(load["layers"]):
        ids = reference[layer]
        expected = torch.bincount(ids.flatten(), minlength=len(load["tokens"][row])).tolist()
        assert load["tokens"][row] == expected, f"layer {layer}"
        assert sum(load["dropped"][row]) == 0
