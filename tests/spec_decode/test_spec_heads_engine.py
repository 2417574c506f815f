"""Medusa, EAGLE and EAGLE-3 heads in their public checkpoint layouts, served by the engine: tiny random
heads propose poorly, and the output is still exactly the non-speculative output."""

from __future__ import annotations

import pytest
from test_heads import (
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    TARGET_LAYERS,
    Eagle1Reference,
    Eagle3Reference,
    medusa_tensors,
    write_checkpoint,
)

from kvtide import LLM, SamplingParams

MAX_MODEL_LEN = 64
PROMPTS = ["Hello", "abc abc abc abc", "The quick brown fox", "1 2 3 1 2 3 1 2 3", "draft tokens", "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def target_dir(checkpoint_factory) -> str:
    """The 8-layer Llama of test_heads.py (EAGLE-3 reads three of its layers)."""
    return checkpoint_factory("LlamaForCausalLM", seed=0, hidden_size=HIDDEN, intermediate_size=INTER,
                              num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS,
                              num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_MODEL_LEN)


def make_llm(model_dir: str, spec: dict | None = None, **kwargs) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="4MiB",
               speculative_config=spec, **kwargs)


def head_dir(method: str, tmp_path_factory, vocab_size: int) -> str:
    path = tmp_path_factory.mktemp(method)
    if method == "medusa":
        return write_checkpoint(path, {"medusa_num_heads": 4, "medusa_num_layers": 1},
                                medusa_tensors(4, 1, vocab_size, seed=1))
    if method == "eagle":
        return Eagle1Reference(seed=10).write(path)
    return Eagle3Reference(seed=30, target_vocab=vocab_size).write(path)


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_heads_serve_exact_output(target_dir, tmp_path_factory, method):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(target_dir).vocab_size
    spec = {"method": method, "model": head_dir(method, tmp_path_factory, vocab), "num_speculative_tokens": 3,
            "adaptive": False, "disable_by_batch_size": 8}
    base = make_llm(target_dir).generate(PROMPTS, GREEDY)
    llm = make_llm(target_dir, spec, enable_prefix_caching=True, max_num_batched_tokens=16)
    for _ in range(2):  # cold, then over a warm prefix cache
        out = llm.generate(PROMPTS, GREEDY)
        for a, b in zip(base, out, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
            for t, x, y in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert y[t].logprob == pytest.approx(x[t].logprob, abs=1e-4)
    stats = llm.engine.core.get_stats().spec_decoding
    assert 0 < stats["num_drafts"] < stats["num_draft_tokens"] <= 3 * stats["num_drafts"]
    assert llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks == 0


def test_head_checks_at_startup(target_dir, tmp_path_factory, checkpoint_factory):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(target_dir).vocab_size
    medusa = head_dir("medusa", tmp_path_factory, vocab)
    with pytest.raises(ValueError, match="'eagle' but .* holds a 'medusa' head"):
        make_llm(target_dir, {"method": "eagle", "model": medusa, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="only 4 heads"):
        make_llm(target_dir, {"method": "medusa", "model": medusa, "num_speculative_tokens": 5})
    wide = checkpoint_factory("LlamaForCausalLM", seed=0, max_position_embeddings=MAX_MODEL_LEN)  # hidden 128
    with pytest.raises(ValueError, match="hidden size"):
        make_llm(wide, {"method": "eagle", "model": Eagle1Reference(seed=1).write(tmp_path_factory.mktemp("e")),
                        "num_speculative_tokens": 2})
