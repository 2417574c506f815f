"""The engine counts the tokens each step scheduled (kvtide:iteration_tokens_total)."""

from __future__ import annotations

from kvtide import LLM, SamplingParams
from kvtide.engine.messages import ITERATION_TOKEN_BUCKETS


def test_tokens_per_step_are_counted_by_bucket(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    try:
        # One prompt of 20 tokens, alone: a 20-token prefill step, then 4 decode steps of 1 token.
        llm.generate([{"prompt_token_ids": list(range(3, 23))}],
                     SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        stats = llm.engine.core.get_stats()
    finally:
        llm.shutdown()
    counts = dict(zip(ITERATION_TOKEN_BUCKETS + (float("inf"),), stats.iteration_tokens["counts"], strict=True))
    assert counts[1] == 4 and counts[32] == 1 and sum(counts.values()) == 5
    assert stats.iteration_tokens["sum"] == 24 and stats.iteration_tokens["count"] == 5
    assert (stats.max_num_seqs, stats.max_num_batched_tokens) == (4, 256)
