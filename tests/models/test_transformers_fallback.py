"""The transformers fallback (--model-impl transformers): Hugging Face's modeling code with kvtide's
paged attention gives HF `generate`'s greedy tokens and logprobs in float32, through every engine
path that moves K/V (batches, chunked prefill, preemption, a warm prefix cache), for an
architecture kvtide implements (forced) and one it does not (auto); and it is refused clearly where
it cannot run.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from hf_reference import CJK_EMOJI_PROMPT, LONG_PROMPT, hf_greedy, hf_prompt_ids
from test_hf_parity import (
    GREEDY,
    GREEDY_LOGPROBS,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    TOP_K,
    assert_greedy_matches_hf,
    assert_logprobs_match_hf,
    assert_prompt_logprobs_match_hf,
    make_llm,
)

from kvtide import SamplingParams
from kvtide.engine_args import EngineArgs
from kvtide.models.model_impl import resolve_model_impl
from kvtide.models.preflight import check_checkpoint_dir
from kvtide.models.registry import supported_architectures
from kvtide.models.transformers_fallback import TransformersForCausalLM

GRANITE = dict(attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.6, logits_scaling=1.7)
"""Granite's multipliers away from their defaults: HF's own attention scaling (0.3, not head_dim ** -0.5)
must reach kvtide's attention, and the logit scaling must reach compute_logits."""
CASES = {
    "llama-forced": ("LlamaForCausalLM", {}, "transformers"),
    "granite-auto": ("GraniteForCausalLM", GRANITE, "auto"),
    "gpt2-auto": ("GPT2LMHeadModel", {}, "auto"),
}
"""(architecture, config overrides, --model-impl): a native architecture forced through the fallback,
and two kvtide has no module for, which auto sends there. GPT-2 adds learned absolute positions
(kvtide's positions must reach HF) and 4 KV heads where the config's unused num_key_value_heads
says 2 (the cache must be sized by what HF's modules pass, not by that field)."""


def case_dir(checkpoint_factory, case: str) -> str:
    architecture, overrides, _ = CASES[case]
    return checkpoint_factory(architecture, **overrides)


def fallback_llm(model_dir: str, case: str, **kwargs):
    llm = make_llm(model_dir, model_impl=CASES[case][2], **kwargs)
    assert isinstance(llm.engine.core.executor.runner.model, TransformersForCausalLM)
    return llm


@pytest.mark.parametrize("case", list(CASES))
def test_batches_and_chunked_prefill_match_hf(checkpoint_factory, case):
    model_dir = case_dir(checkpoint_factory, case)
    budget = 13  # chunks below most prompts' length and not a multiple of the block size
    llm = fallback_llm(model_dir, case, max_num_batched_tokens=budget)
    three = [PROMPTS[0], CJK_EMOJI_PROMPT, LONG_PROMPT, PROMPTS[3]]
    assert sum(len(hf_prompt_ids(model_dir, p)) > budget for p in three) >= 3
    outputs = llm.generate(three, GREEDY_LOGPROBS)
    assert_greedy_matches_hf(model_dir, three, outputs)
    for i, (prompt, out) in enumerate(zip(three, outputs, strict=True)):
        assert_logprobs_match_hf(hf_greedy(model_dir, prompt, MAX_TOKENS), out, f"{case} prompt {i}")
        assert_prompt_logprobs_match_hf(model_dir, out, f"{case} prompt {i}")
    alone = llm.generate([LONG_PROMPT], GREEDY_LOGPROBS)
    assert_greedy_matches_hf(model_dir, [LONG_PROMPT], alone)
    assert_logprobs_match_hf(hf_greedy(model_dir, LONG_PROMPT, MAX_TOKENS), alone[0], f"{case} alone")


@pytest.mark.parametrize("case", list(CASES))
def test_preemption_matches_hf(checkpoint_factory, case):
    model_dir = case_dir(checkpoint_factory, case)
    probe = fallback_llm(model_dir, case, kv_cache_memory="4MiB")
    block_bytes = probe.engine.core.executor.kv_bytes_per_block()
    num_blocks = -(-MAX_MODEL_LEN // 16) + 3  # room for the longest request and little else
    prompts = PROMPTS[:10]
    llm = fallback_llm(model_dir, case, kv_cache_memory=str(num_blocks * block_bytes))
    outputs = llm.generate(prompts, GREEDY)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert_greedy_matches_hf(model_dir, prompts, outputs)
    scheduler.kv_cache_manager.pool.check_integrity()
    assert scheduler.kv_cache_manager.pool.num_used_blocks == 0


@pytest.mark.parametrize("case", list(CASES))
def test_warm_prefix_cache_matches_hf(checkpoint_factory, case):
    model_dir = case_dir(checkpoint_factory, case)
    prompts = [LONG_PROMPT] + [LONG_PROMPT[:200] + suffix for suffix in (" and then", " or else the pool")]
    llm = fallback_llm(model_dir, case, enable_prefix_caching=True, max_num_batched_tokens=64)
    assert_greedy_matches_hf(model_dir, prompts, llm.generate(prompts, GREEDY))
    warm = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K))
    assert_greedy_matches_hf(model_dir, prompts, warm)
    assert warm[0].num_cached_tokens >= 320 and all(out.num_cached_tokens >= 192 for out in warm[1:])
    for i, (prompt, out) in enumerate(zip(prompts, warm, strict=True)):
        assert_logprobs_match_hf(hf_greedy(model_dir, prompt, MAX_TOKENS), out, f"{case} warm prompt {i}")


@pytest.mark.parametrize("architecture, overrides", [
    ("MistralForCausalLM", dict(sliding_window=16)),
    # Layers 2 and 3 slide, 0 and 1 see everything: one block table per layer kind (kv_cache/hybrid.py).
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
], ids=["mistral", "qwen2-mixed"])
def test_sliding_window_through_the_fallback_matches_hf(checkpoint_factory, architecture, overrides):
    # HF passes each layer's window to the attention function; kvtide's layers take it from the config.
    model_dir = checkpoint_factory(architecture, **overrides)
    llm = make_llm(model_dir, model_impl="transformers", max_num_batched_tokens=48)
    prompts = [LONG_PROMPT, PROMPTS[5]]
    assert_greedy_matches_hf(model_dir, prompts, llm.generate(prompts, GREEDY))


def test_hf_scaling_matters(checkpoint_factory):
    """Guard for the Granite case: the same weights with the usual 1/sqrt(head_dim) attention scale
    and no logit scaling continue the prompt differently in HF, so matching HF checks both."""
    head_dim = 128 // 4
    plain = dict(GRANITE, attention_multiplier=head_dim ** -0.5, logits_scaling=1.0)
    ours = hf_greedy(case_dir(checkpoint_factory, "granite-auto"), LONG_PROMPT, MAX_TOKENS)
    other = hf_greedy(checkpoint_factory("GraniteForCausalLM", **plain), LONG_PROMPT, MAX_TOKENS)
    assert ours.token_ids != other.token_ids


# ---- choosing the implementation -----------------------------------------------------------
def _config(model_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def test_model_impl_resolution(llama_dir, checkpoint_factory):
    llama, granite = _config(llama_dir), _config(case_dir(checkpoint_factory, "granite-auto"))
    assert resolve_model_impl(llama, "auto", False) == "kvtide"
    assert resolve_model_impl(llama, "vllm", False) == "kvtide"
    assert resolve_model_impl(llama, "transformers", False) == "transformers"
    assert resolve_model_impl(granite, "auto", False) == "transformers"
    with pytest.raises(ValueError, match="GraniteForCausalLM") as info:
        resolve_model_impl(granite, "kvtide", False)
    assert "--model-impl transformers" in str(info.value) and "Qwen3ForCausalLM" in str(info.value)
    with pytest.raises(ValueError, match="model_impl must be one of"):
        resolve_model_impl(llama, "hf", False)
    config = EngineArgs(model=llama_dir, model_impl="transformers").create_engine_config(llama_dir)
    assert config.model_config.model_impl == "transformers"


def _edited_copy(src: str, dst: str, **edits) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(edits)
    with open(path, "w") as f:
        json.dump(config, f)
    return dst


def _engine_error(model_dir: str, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        EngineArgs(model=model_dir, **kwargs).create_engine_config(model_dir)
    return str(info.value)


def test_unknown_architecture_names_itself_and_both_ways_forward(llama_dir, tmp_path):
    model_dir = _edited_copy(llama_dir, str(tmp_path / "unknown"), architectures=["FancyNewForCausalLM"])
    message = _engine_error(model_dir)
    assert "FancyNewForCausalLM" in message and "--model-impl transformers" in message
    assert all(name in message for name in supported_architectures())
    assert "FancyNewForCausalLM" in _engine_error(model_dir, model_impl="transformers")
    with pytest.raises(ValueError) as info:  # `kvtide serve`'s checkpoint preflight says the same
        check_checkpoint_dir(model_dir)
    assert str(info.value) == message


def test_preflight_leaves_a_transformers_architecture_to_the_engine(checkpoint_factory):
    granite = case_dir(checkpoint_factory, "granite-auto")
    check_checkpoint_dir(granite)
    with pytest.raises(ValueError, match="GraniteForCausalLM"):
        check_checkpoint_dir(granite, model_impl="kvtide")


def test_what_the_fallback_refuses(llama_dir, checkpoint_factory, tmp_path):
    no_interface = _edited_copy(llama_dir, str(tmp_path / "stablelm"), architectures=["StableLmForCausalLM"])
    assert "attention interface" in _engine_error(no_interface)
    enc_dec = _edited_copy(llama_dir, str(tmp_path / "encdec"), architectures=["OlmoForCausalLM"],
                           is_encoder_decoder=True)
    assert "encoder-decoder" in _engine_error(enc_dec)
    remote = _edited_copy(llama_dir, str(tmp_path / "remote"), architectures=["MyOwnForCausalLM"],
                          auto_map={"AutoModelForCausalLM": "modeling_mine.MyOwnForCausalLM"})
    assert "--trust-remote-code" in _engine_error(remote)
    granite = case_dir(checkpoint_factory, "granite-auto")
    assert "--tensor-parallel-size" in _engine_error(granite, tensor_parallel_size=2)
    assert "--speculative-config" in _engine_error(
        granite, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_fast_paths_say_why_not(checkpoint_factory):
    model_dir = case_dir(checkpoint_factory, "granite-auto")
    model = fallback_llm(model_dir, "granite-auto").engine.core.executor.runner.model
    assert "transformers fallback" in model.cuda_graph_unsupported()
    assert isinstance(model.fused_decode_layers(), str)
    assert len(model.attention_layers()) == 4
    assert [a.scale for a in model.attention_layers()] == [GRANITE["attention_multiplier"]] * 4
