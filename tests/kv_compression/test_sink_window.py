"""StreamingLLM-style attention (--kv-sink-tokens N --kv-window-tokens W) against the same policy
written plainly on Hugging Face (every query masked to the first N and the last W positions), on a
tiny seeded Llama: greedy tokens equal, and the request's live blocks stay bounded by the sinks and
the window while the generation runs far past them."""

from __future__ import annotations

import pytest
import torch
from hf_masked import load_eager, masked_greedy

from kvtide import LLM, SamplingParams

SINKS, WINDOW, BLOCK = 4, 40, 16
PROMPT = "Attention sinks keep the first tokens while the window slides: " * 2
MAX_TOKENS = 160


def sink_window_visible(p: int, n: int) -> torch.Tensor:
    j = torch.arange(n)
    return (j <= p) & ((j > p - WINDOW) | (j < SINKS))


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory) -> str:
    return checkpoint_factory("LlamaForCausalLM", max_position_embeddings=1024)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_sinks_and_window_equal_the_plain_masked_reference(model_dir, backend):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory="8MiB",
              block_size=BLOCK, kv_sink_tokens=SINKS, kv_window_tokens=WINDOW, attention_backend=backend,
              enable_prefix_caching=False, max_num_batched_tokens=48)  # prefill in chunks, freeing between
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    manager = engine.core.scheduler.kv_cache_manager
    peak = 0
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        peak = max(peak, manager.num_live_blocks("r"))
    prompt_ids = outputs[-1].prompt_token_ids
    model = load_eager(model_dir)
    expected = masked_greedy(model, list(prompt_ids), MAX_TOKENS, sink_window_visible)
    assert list(outputs[-1].outputs[0].token_ids) == expected
    # the policy is really applied: full attention continues differently
    assert masked_greedy(model, list(prompt_ids), MAX_TOKENS, lambda p, n: torch.arange(n) <= p) != expected
    # 1 sink block + the window and one 48-token chunk, never the whole sequence
    total = -(-(len(prompt_ids) + MAX_TOKENS) // BLOCK)
    bound = 1 + -(-(WINDOW + 48 + BLOCK - 2) // BLOCK)
    assert peak <= bound < total
    manager.check_integrity()
    assert manager.pool.num_free_blocks == manager.num_blocks


def test_a_pool_smaller_than_max_model_len_serves_windowed_requests(model_dir):
    """A request under sinks + window holds only what they span, so the engine accepts a pool of
    far fewer tokens than max_model_len and runs a request of nearly max_model_len through it; a
    pool too small even for that is refused with the size it needs."""
    kwargs = dict(device="cpu", dtype="float32", max_model_len=512, block_size=BLOCK, kv_sink_tokens=SINKS,
                  kv_window_tokens=WINDOW, enable_prefix_caching=False, max_num_batched_tokens=32)
    probe = LLM(model_dir, kv_cache_memory="4MiB", **kwargs)
    block_bytes = probe.engine.core.executor.kv_bytes_per_block()
    del probe
    llm = LLM(model_dir, kv_cache_memory=8 * block_bytes, **kwargs)  # 128 tokens of pool
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=350, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + 350 <= 512 and len(out.outputs[0].token_ids) == 350
    with pytest.raises(ValueError, match="fewer than a request of max_model_len=512 needs at once"):
        LLM(model_dir, kv_cache_memory=3 * block_bytes, **kwargs)
