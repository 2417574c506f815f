"""Gemma 3 and Gemma 2 (models/gemma.py) against Hugging Face in float32: greedy tokens equal to
`generate`, chosen-token logprobs within 1e-4, through batching, chunked prefill, preemption, a warm
prefix cache and prompts longer than the sliding window; and the text tower of a
Gemma3ForConditionalGeneration checkpoint.

The tiny checkpoints mix sliding (24-token window) and full layers, give the two layer kinds rope
tables of their own (Gemma 3: a linear-scaled global rope), scale attention by an unusual
query_pre_attn_scalar, tie the embeddings and (Gemma 2) soft-cap attention scores and logits.
transformers initializes Gemma's norm weights to 0 (a scale of 1 + 0), which would leave the (1 + w)
form untested, so the fixtures rewrite every norm weight with seeded noise; Gemma 2's q/k projections
are scaled up so that its attention scores reach the soft cap. Guards check that the window and
the cap change HF's own tokens, so matching HF tests them.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hf_reference import (
    CJK_EMOJI_PROMPT,
    LONG_PROMPT,
    assert_greedy_and_logprobs_match_hf,
    hf_greedy,
    hf_prompt_ids,
)
from safetensors.torch import load_file, save_file

from kvtide import LLM, SamplingParams
from kvtide.kv_cache.hybrid import HybridKVCacheManager, blocks_held
from kvtide.kv_cache.manager import cdiv
from kvtide.models.demo import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, build_byte_tokenizer
from kvtide.models.gemma import rope_config
from kvtide.models.llama import sliding_window_for_layer

WINDOW = 24
MAX_TOKENS = 24
MAX_MODEL_LEN = 400
LOGPROB_TOL = 1e-4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
TEXT_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                   query_pre_attn_scalar=20, max_position_embeddings=1024, tie_word_embeddings=True,
                   initializer_range=0.02)
"""initializer_range 0.02 (not the fixtures' usual 0.2): Gemma's sqrt(hidden) embedding scale and
unit norms make larger weights collapse greedy decoding onto one repeated token."""
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
GEMMA3_CONFIG = dict(TEXT_CONFIG, rope_parameters=GEMMA3_ROPE)
ATTN_SOFT_CAP = 4.0
GEMMA2_CONFIG = dict(TEXT_CONFIG, attn_logit_softcapping=ATTN_SOFT_CAP, final_logit_softcapping=8.0)
QK_GAIN = {"Gemma2ForCausalLM": 8.0, "Gemma3ForCausalLM": 1.0}
"""Factor on q_proj and k_proj weights: Gemma 2 has no q/k norms, so scores stay far below the cap
otherwise."""

PROMPTS = ["Hello", CJK_EMOJI_PROMPT, LONG_PROMPT, "The quick brown fox jumps over the lazy dog."]
"""6 to over 300 tokens: all but the first cross the window."""
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
ARCHS = ["Gemma3ForCausalLM", "Gemma2ForCausalLM"]


def perturb_weights(model_dir: str, qk_gain: float, seed: int = 1) -> None:
    """Norm weights (stored as offsets from 1) to seeded noise, q and k projections times qk_gain."""
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        if name.endswith("norm.weight") and "vision" not in name:
            tensors[name] = torch.randn(tensors[name].shape, generator=generator) * 0.5
        elif name.endswith(("q_proj.weight", "k_proj.weight")) and "vision" not in name:
            tensors[name] = tensors[name] * qk_gain
    save_file(tensors, path, metadata={"format": "pt"})


def gemma_checkpoint(checkpoint_factory, tmp_path_factory, arch: str, **overrides) -> str:
    config = dict(GEMMA3_CONFIG if arch == "Gemma3ForCausalLM" else GEMMA2_CONFIG, **overrides)
    built = checkpoint_factory(arch, seed=0, **config)
    model_dir = str(tmp_path_factory.mktemp(f"{arch.lower()}-perturbed"))
    shutil.copytree(built, model_dir, dirs_exist_ok=True)
    perturb_weights(model_dir, QK_GAIN[arch])
    return model_dir


@pytest.fixture(scope="module")
def gemma_dirs(checkpoint_factory, tmp_path_factory) -> dict[str, str]:
    return {arch: gemma_checkpoint(checkpoint_factory, tmp_path_factory, arch) for arch in ARCHS}


def make_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "16MiB")
    kwargs.setdefault("enable_prefix_caching", False)
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, **kwargs)


def assert_matches_hf(model_dir: str, prompts: list[str], outputs, check_logprobs: bool = False) -> None:
    assert_greedy_and_logprobs_match_hf(model_dir, prompts, outputs, MAX_TOKENS,
                                        LOGPROB_TOL if check_logprobs else None)


# ---- the checkpoints test what they should ---------------------------------------------------------
def test_prompts_cross_the_window_and_outputs_are_not_degenerate(gemma_dirs):
    for arch, model_dir in gemma_dirs.items():
        lengths = [len(hf_prompt_ids(model_dir, p)) for p in PROMPTS]
        assert sum(n > WINDOW for n in lengths) == 3 and max(lengths) > 300, lengths
        distinct = [len(set(hf_greedy(model_dir, p, MAX_TOKENS).token_ids)) for p in PROMPTS]
        assert sum(distinct) >= 2 * len(PROMPTS), (arch, distinct)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_window_changes_hf_tokens(checkpoint_factory, tmp_path_factory, gemma_dirs, arch):
    """Guard: every layer attending fully continues differently, so matching HF checks the window."""
    full = gemma_checkpoint(checkpoint_factory, tmp_path_factory, arch, layer_types=["full_attention"] * 4)
    assert hf_greedy(full, LONG_PROMPT, MAX_TOKENS).token_ids != \
        hf_greedy(gemma_dirs[arch], LONG_PROMPT, MAX_TOKENS).token_ids


def test_the_attention_soft_cap_changes_hf_tokens(checkpoint_factory, tmp_path_factory, gemma_dirs):
    """Guard: Gemma 2 without the attention cap continues differently, so matching HF checks the cap."""
    uncapped = gemma_checkpoint(checkpoint_factory, tmp_path_factory, "Gemma2ForCausalLM",
                                attn_logit_softcapping=None)
    capped = gemma_dirs["Gemma2ForCausalLM"]
    assert any(hf_greedy(uncapped, p, MAX_TOKENS).token_ids != hf_greedy(capped, p, MAX_TOKENS).token_ids
               for p in PROMPTS)


def test_layer_kinds_and_rope_bases_from_older_config_fields():
    """Configs without layer_types or per-type rope parameters: every sliding_window_pattern-th layer
    is global (transformers' rule: sliding iff (i + 1) % pattern), and the sliding layers rotate with
    rope_local_base_freq while the global ones keep the config's rope."""
    from types import SimpleNamespace

    config = SimpleNamespace(sliding_window=16, sliding_window_pattern=3, num_hidden_layers=6, layer_types=None)
    assert [sliding_window_for_layer(config, i) for i in range(6)] == [16, 16, None, 16, 16, None]
    legacy = SimpleNamespace(rope_parameters={"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             rope_local_base_freq=1e4)
    assert rope_config(legacy, "sliding_attention").rope_parameters == {"rope_type": "default", "rope_theta": 1e4}
    assert rope_config(legacy, "full_attention") is legacy


# ---- engine paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_one_and_of_four_match_hf_with_logprobs(gemma_dirs, arch):
    model_dir = gemma_dirs[arch]
    llm = make_llm(model_dir)
    assert isinstance(llm.engine.core.scheduler.kv_cache_manager, HybridKVCacheManager)
    assert_matches_hf(model_dir, [LONG_PROMPT], llm.generate([LONG_PROMPT], GREEDY_LOGPROBS), check_logprobs=True)
    assert_matches_hf(model_dir, PROMPTS, llm.generate(PROMPTS, GREEDY_LOGPROBS), check_logprobs=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_hf(gemma_dirs, arch):
    model_dir = gemma_dirs[arch]
    llm = make_llm(model_dir, max_num_batched_tokens=13)  # below every prompt but "Hello"
    assert_matches_hf(model_dir, PROMPTS, llm.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches_hf(gemma_dirs, arch):
    model_dir = gemma_dirs[arch]
    probe = make_llm(model_dir, kv_cache_memory="1MiB", max_num_batched_tokens=64)
    block_bytes = probe.engine.core.executor.kv_bytes_per_block()
    groups = probe.engine.core.scheduler.kv_cache_manager.groups
    num_blocks = blocks_held(groups, MAX_MODEL_LEN, 64, 16) + 3  # room for the longest request and little else
    llm = make_llm(model_dir, kv_cache_memory=str(num_blocks * block_bytes), max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS * 2, GREEDY_LOGPROBS)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert_matches_hf(model_dir, PROMPTS * 2, outputs, check_logprobs=True)
    assert scheduler.kv_cache_manager.pool.num_used_blocks == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_warm_prefix_cache_matches_hf(gemma_dirs, arch):
    model_dir = gemma_dirs[arch]
    shared = [LONG_PROMPT[:200] + suffix for suffix in (" and then", "!")]
    prompts = PROMPTS + shared
    llm = make_llm(model_dir, enable_prefix_caching=True, max_num_batched_tokens=64)
    assert_matches_hf(model_dir, prompts, llm.generate(prompts, GREEDY))
    warm = llm.generate(prompts, GREEDY)
    assert_matches_hf(model_dir, prompts, warm)
    assert warm[prompts.index(LONG_PROMPT)].num_cached_tokens >= 320
    assert all(out.num_cached_tokens >= 192 for out in warm[len(PROMPTS):])


def test_sliding_layers_free_their_blocks(gemma_dirs):
    """The windowed layers' tables hold only the blocks their window reads, the full layer's all of
    them, while a long prompt is prefilled in chunks and decoded."""
    model_dir = gemma_dirs["Gemma3ForCausalLM"]
    llm = make_llm(model_dir, max_num_batched_tokens=32, block_size=16)
    engine = llm.engine
    manager = engine.core.scheduler.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager)
    assert sorted((g.window, g.layers) for g in manager.groups if g.window is None) == [(None, (1,))]
    assert sorted(g.layers for g in manager.groups if g.window == WINDOW) == [(0,), (2,), (3,)]
    engine.add_request("long", LONG_PROMPT, GREEDY)
    held: list[list[int]] = []
    out = None
    while engine.has_unfinished_requests():
        for step_out in engine.step():
            out = step_out if step_out.finished else out
        for core_id in manager.req_to_blocks:
            held.append([m.num_live_blocks(core_id) for m in manager.managers])
    assert out is not None and out.outputs[0].token_ids == hf_greedy(model_dir, LONG_PROMPT, MAX_TOKENS).token_ids
    full_group = next(i for i, g in enumerate(manager.groups) if g.window is None)
    total = len(hf_prompt_ids(model_dir, LONG_PROMPT)) + MAX_TOKENS
    assert held[-1][full_group] >= cdiv(total, 16) - 1
    for blocks in held:
        assert all(n <= cdiv(WINDOW, 16) + 2 for g, n in enumerate(blocks) if g != full_group), blocks


# ---- backends --------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_the_transformers_fallback_matches_hf(gemma_dirs, arch):
    """`--model-impl transformers` on the same checkpoints: HF's Gemma modules with kvtide's paged
    attention (the window per layer, and Gemma 2's soft cap, passed through to the backend)."""
    from kvtide.models.transformers_fallback import TransformersForCausalLM

    llm = make_llm(gemma_dirs[arch], model_impl="transformers", max_num_batched_tokens=48)
    assert isinstance(llm.engine.core.executor.runner.model, TransformersForCausalLM)
    assert_matches_hf(gemma_dirs[arch], PROMPTS, llm.generate(PROMPTS, GREEDY_LOGPROBS), check_logprobs=True)


@pytest.mark.parametrize("backend", ["torch", "torch_ref"])
def test_gemma2_on_the_torch_backends_matches_hf(gemma_dirs, backend):
    """The default CPU backend sends soft-capped layers to the torch paths (tested above); these are them."""
    model_dir = gemma_dirs["Gemma2ForCausalLM"]
    llm = make_llm(model_dir, attention_backend=backend, max_num_batched_tokens=13)
    assert_matches_hf(model_dir, PROMPTS, llm.generate(PROMPTS, GREEDY_LOGPROBS), check_logprobs=True)


def test_fast_paths_say_why_gemma_is_not_on_them(gemma_dirs):
    llm = make_llm(gemma_dirs["Gemma3ForCausalLM"])
    model = llm.engine.core.executor.runner.model
    assert model.fused_decode is None
    assert "fused decode" in model.fused_decode_layers()
    assert all("fused decode" in layer.fused_decode_plan() for layer in model.layers)
    assert model.cuda_graph_unsupported() is not None


# ---- the text tower of the multimodal checkpoint ----------------------------------------------------
@pytest.fixture(scope="module")
def gemma3_multimodal_dir(tmp_path_factory) -> str:
    """A Gemma3ForConditionalGeneration with a one-layer SigLIP tower and the Gemma 3 text config above;
    its image tokens are bytes UTF-8 never holds (0xC1, 0xFE, 0xFF), so no prompt reaches them."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(GEMMA3_CONFIG, vocab_size=BYTE_VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                pad_token_id=PAD_ID)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=196, eoi_token_index=257, image_token_index=258,
                          tie_word_embeddings=True, initializer_range=0.02,
                          architectures=["Gemma3ForConditionalGeneration"])
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    path = str(tmp_path_factory.mktemp("gemma3-multimodal"))
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer(1024).save_pretrained(path)
    perturb_weights(path, qk_gain=1.0)
    return path


def nest_under_model(model_dir: str, tmp_path_factory) -> str:
    """A copy of the checkpoint with its tensors named as transformers 5 holds them in memory
    (model.language_model.*, model.vision_tower.*) instead of as it saves them (language_model.model.*)."""
    renamed = str(tmp_path_factory.mktemp("gemma3-multimodal-nested"))
    shutil.copytree(model_dir, renamed, dirs_exist_ok=True)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    assert sum(name.startswith("language_model.model.") for name in tensors) > 40
    nested = {("model.language_model." + name.removeprefix("language_model.model.")
               if name.startswith("language_model.model.") else "model." + name): t for name, t in tensors.items()}
    save_file(nested, os.path.join(renamed, "model.safetensors"), metadata={"format": "pt"})
    return renamed


@pytest.mark.parametrize("layout", ["as-saved", "nested"])
def test_conditional_generation_text_tower_matches_hf(gemma3_multimodal_dir, tmp_path_factory, layout):
    from transformers import Gemma3ForConditionalGeneration

    names = load_file(os.path.join(gemma3_multimodal_dir, "model.safetensors")).keys()
    assert any("vision_tower" in n for n in names) and any("language_model" in n for n in names)
    hf = Gemma3ForConditionalGeneration.from_pretrained(gemma3_multimodal_dir, dtype=torch.float32).eval()
    tokenizer = build_byte_tokenizer(1024)
    served = gemma3_multimodal_dir if layout == "as-saved" else nest_under_model(gemma3_multimodal_dir,
                                                                                  tmp_path_factory)
    llm = make_llm(served)
    outputs = llm.generate(PROMPTS, GREEDY_LOGPROBS)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = torch.tensor([tokenizer(prompt).input_ids])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD_ID, output_logits=True, return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, ids.shape[1]:].tolist()
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.outputs[0].token_ids == ref_tokens
        ref_logprobs = torch.cat(ref.logits).float().log_softmax(dim=-1)
        for step, token in enumerate(ref_tokens):
            assert out.outputs[0].logprobs[step][token].logprob == pytest.approx(
                ref_logprobs[step, token].item(), abs=LOGPROB_TOL)
