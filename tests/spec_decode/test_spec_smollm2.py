"""Speculative decoding on the real SmolLM2-135M-Instruct: acceptance on text that copies its input.

The n-gram proposer must find most of a rewrite or a code edit in the prompt (acceptance asserted
above a floor, about half the rate measured when the test was written); self-speculation by early
exit and the target drafting for itself check the bookkeeping at partial and full acceptance. The
output equals non-speculative decoding in every case.
"""

from __future__ import annotations

import pytest

from kvtide import LLM, SamplingParams
from kvtide.bench.datasets import grounded_conversations

GREEDY = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def conversations() -> list[list[dict]]:
    return grounded_conversations()[:3]


@pytest.fixture(scope="module")
def reference(smollm2_llm, conversations) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in smollm2_llm.chat(conversations, GREEDY)]


def run(conversations, spec: dict) -> tuple[list[list[int]], dict]:
    llm = LLM(model="smollm2", device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory="192MiB",
              speculative_config=spec)
    tokens = [o.outputs[0].token_ids for o in llm.chat(conversations, GREEDY)]
    stats = llm.engine.core.get_stats().spec_decoding
    assert llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks == 0
    return tokens, stats


def test_ngram_accepts_most_of_an_input_grounded_rewrite(conversations, reference):
    tokens, stats = run(conversations, {"method": "ngram", "num_speculative_tokens": 5})
    assert tokens == reference
    rate = stats["num_accepted_tokens"] / stats["num_draft_tokens"]
    mean_length = 1 + stats["num_accepted_tokens"] / stats["num_drafts"]
    print(f"ngram on SmolLM2: acceptance {rate:.2f}, mean accepted length {mean_length:.2f}, {stats}")
    assert rate >= 0.3 and mean_length >= 2.0


def test_layer_skip_and_self_draft_bookkeeping(conversations, reference):
    tokens, stats = run(conversations, {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 24,
                                        "adaptive": False})
    assert tokens == reference
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    tokens, stats = run(conversations[:1], {"method": "draft_model", "model": "smollm2",
                                            "num_speculative_tokens": 4, "adaptive": False})
    assert tokens == reference[:1]
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
