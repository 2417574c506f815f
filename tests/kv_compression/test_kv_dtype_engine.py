"""Quantized KV caches through the whole engine: the pool holds the format's multiple of tokens,
and every feature that shares, copies or recomputes blocks (prefix caching, forks, preemption,
chunked prefill, speculative decoding) gives the same tokens on quantized blocks as without it.

A quantized cache is always attended dequantized (a prefill never reads its own unquantized K/V),
so a token's computation does not depend on whether its context was computed in this step, an
earlier chunk, another request (prefix hit) or before a preemption."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtide import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SHARED = "The history of the paged key value cache begins with a question about memory: "
PROMPTS = [SHARED + "who holds it?", SHARED + "what does it cost?", "Short one.", SHARED * 2]
BACKENDS = ["torch", "cpu"]


def make_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "8MiB")
    kwargs.setdefault("enable_prefix_caching", False)
    kwargs.setdefault("max_model_len", 512)
    return LLM(model_dir, device="cpu", dtype="float32", **kwargs)


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def wide_head_dir(checkpoint_factory) -> str:
    """head_dim 64 (SmolLM2's), 2 KV heads."""
    return checkpoint_factory("LlamaForCausalLM", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=512, num_hidden_layers=2)


def test_pool_holds_the_formats_multiple_of_tokens(wide_head_dir):
    """Blocks for the same --kv-cache-memory, against bytes per token counted here by hand
    (layers 2, KV heads 2, head_dim 64, block 16): K and V codes, plus a float16 scale per token-head
    for int8, plus float16 (scale, min) for int4 V."""
    memory = 4 << 20
    per_token_per_head = {"bfloat16": 2 * 64 * 2, "float32": 2 * 64 * 4, "fp8": 2 * 64, "fp8_e5m2": 2 * 64,
                          "int8": 2 * (64 + 2), "k8v4": (64 + 2) + (32 + 4)}
    blocks = {}
    for name, nbytes in per_token_per_head.items():
        llm = make_llm(wide_head_dir, kv_cache_dtype=name, kv_cache_memory=memory, attention_backend="torch")
        blocks[name] = llm.engine.core.config.cache_config.num_blocks
        assert blocks[name] == memory // (16 * 2 * 2 * nbytes), name
        del llm
    assert blocks["fp8"] / blocks["bfloat16"] == 2.0
    assert blocks["int8"] / blocks["bfloat16"] >= 1.9
    assert blocks["k8v4"] / blocks["bfloat16"] >= 2.5
    assert blocks["int8"] / blocks["float32"] >= 3.8


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["int8", "k8v4", "fp8"])
def test_block_sharing_features_unchanged_on_quantized_blocks(llama_dir, dtype, backend):
    base = make_llm(llama_dir, kv_cache_dtype=dtype, attention_backend=backend, kv_cache_memory="16MiB")
    expected = tokens(base)
    del base
    # prefix caching: the shared head computed once, hit by the others (a second pass hits everything)
    cached = make_llm(llama_dir, kv_cache_dtype=dtype, attention_backend=backend, enable_prefix_caching=True)
    assert tokens(cached) == expected
    assert tokens(cached) == expected
    assert cached.engine.core.scheduler.kv_cache_manager.prefix_stats.hits > 0
    # n=2 greedy samples fork the prompt's blocks and copy the shared partial block on write
    forked = cached.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2))
    assert [[list(c.token_ids) for c in o.outputs] for o in forked] == [[t, t] for t in expected]
    del cached
    # chunked prefill in 32-token chunks, and a pool so small requests are preempted and recomputed
    small = make_llm(llama_dir, kv_cache_dtype=dtype, attention_backend=backend, max_num_batched_tokens=32,
                     kv_cache_memory=_pool_bytes(llama_dir, dtype, blocks=14), max_model_len=200)
    assert tokens(small) == expected
    assert small.engine.core.scheduler.num_preemptions > 0
    del small
    # speculative decoding (n-gram drafts verified over quantized blocks, rejected slots overwritten)
    spec = make_llm(llama_dir, kv_cache_dtype=dtype, attention_backend=backend,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                        "adaptive": False, "disable_by_batch_size": 64})
    assert tokens(spec) == expected


def _pool_bytes(model_dir: str, dtype: str, blocks: int) -> int:
    probe = make_llm(model_dir, kv_cache_dtype=dtype, attention_backend="torch", kv_cache_memory="4MiB")
    return blocks * probe.engine.core.executor.kv_bytes_per_block()


def test_checkpoint_kv_scales_are_loaded(llama_dir, tmp_path):
    """vLLM's checkpoint names for per-layer fp8 KV scales land in each layer's kv_scale."""
    import shutil

    model_dir = tmp_path / "with_scales"
    shutil.copytree(llama_dir, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.125)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    weights["model.layers.1.self_attn.k_proj.k_scale"] = torch.tensor([0.25, 0.75])  # per head: the max
    weights["model.layers.2.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = make_llm(str(model_dir), kv_cache_dtype="fp8")
    scales = [attn.kv_scale.tolist() for attn in llm.engine.core.executor.runner.model.attention_layers()]
    assert scales == [[0.125, 0.5], [0.75, 1.0], [2.0, 2.0], [1.0, 1.0]]
    assert len(tokens(llm, PROMPTS[:1])[0]) == 16
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(-1.0)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="k_scale"):
        make_llm(str(model_dir), kv_cache_dtype="fp8")


def test_calculated_kv_scales_come_from_the_first_pass(llama_dir):
    llm = make_llm(llama_dir, kv_cache_dtype="fp8", calculate_kv_scales=True)
    layers = llm.engine.core.executor.runner.model.attention_layers()
    assert all(attn.kv_scale.tolist() == [1.0, 1.0] for attn in layers)
    first = tokens(llm, PROMPTS[:2])
    scales = [attn.kv_scale.clone() for attn in layers]
    assert all(bool((s > 0).all()) and s.tolist() != [1.0, 1.0] for s in scales)
    assert tokens(llm, PROMPTS[:2]) == first  # set once: later passes keep them
    assert all(torch.equal(s, attn.kv_scale) for s, attn in zip(scales, layers, strict=True))


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_cache_dtype="int3"), "kv_cache_dtype must be one of"),
    (dict(calculate_kv_scales=True), "calculate-kv-scales needs a quantized"),
    (dict(kv_sink_tokens=4), "needs --kv-window-tokens"),
    (dict(kv_window_tokens=0), "kv_window_tokens must be >= 1"),
    (dict(kv_window_tokens=8, kv_sink_tokens=-1), "kv_sink_tokens must be >= 0"),
    (dict(kv_drop_budget=0.5), "needs --kv-drop-policy"),
    (dict(kv_drop_policy="random", kv_drop_budget=0.5), "kv_drop_policy must be one of"),
    (dict(kv_drop_policy="score", enable_prefix_caching=False), r"needs --kv-drop-budget in \(0, 1\]"),
    (dict(kv_drop_policy="score", kv_drop_budget=1.5, enable_prefix_caching=False), r"\(0, 1\]"),
    (dict(kv_drop_policy="score", kv_drop_budget=0.5), "prefix cach"),
    (dict(kv_drop_policy="score", kv_drop_budget=0.5, enable_prefix_caching=False, kv_window_tokens=64),
     "choose one"),
    (dict(kv_drop_policy="score", kv_drop_budget=0.5, enable_prefix_caching=False,
          speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative"),
    (dict(kv_drop_policy="score", kv_drop_budget=0.5, enable_prefix_caching=False, attention_backend="triton"),
     "needs the torch attention paths"),
])
def test_bad_kv_flags_are_refused_before_anything_loads(llama_dir, kwargs, match):
    kwargs.setdefault("enable_prefix_caching", True)
    with pytest.raises(ValueError, match=match):
        LLM(llama_dir, device="cpu", **kwargs)
