"""The whole engine with the Triton attention backend gives the torch backend's greedy tokens:
plain prompts, chunked prefill mixed with decodes, prefix-cache hits, a sliding window, and
speculative verification rows."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kvtide import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.triton

PROMPTS = ["Hello, my name is", "The capital of France", "a", "Once upon a time, in a land far away, there"]


def _greedy_tokens(model_dir: str, backend: str, prompts: list[str], max_tokens: int, device,
                   **kwargs) -> list[list[int]]:
    llm = LLM(model=model_dir, attention_backend=backend, kv_cache_memory="16MiB", max_model_len=128,
              device=device.type, dtype="float32", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # Prefix-cache hits: the same prompts again now start from cached blocks.
    tokens += [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], params)]
    return [list(t) for t in tokens]


def test_triton_engine_equals_torch_engine(llama_dir, device):
    """On CUDA the Triton side also runs the fused layers and decode CUDA graphs."""
    kwargs = dict(block_size=8, max_num_batched_tokens=24)  # long prompts are chunked beside decodes
    expected = _greedy_tokens(llama_dir, "torch", PROMPTS, 5, device, **kwargs)
    assert _greedy_tokens(llama_dir, "triton", PROMPTS, 5, device, **kwargs) == expected


def test_triton_engine_sliding_window(checkpoint_factory, device):
    model_dir = checkpoint_factory("MistralForCausalLM", sliding_window=6)
    prompts = PROMPTS[1:2] + PROMPTS[3:]
    expected = _greedy_tokens(model_dir, "torch", prompts, 4, device, block_size=4)
    assert _greedy_tokens(model_dir, "triton", prompts, 4, device, block_size=4) == expected


def test_triton_engine_speculative_verification(llama_dir, device):
    """Verification rows (last token + drafts) through the Triton kernel; the target drafting for
    itself, so every row carries its full K + 1 tokens."""
    spec = {"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 3, "adaptive": False}
    expected = _greedy_tokens(llama_dir, "torch", PROMPTS, 6, device, block_size=8)
    assert _greedy_tokens(llama_dir, "triton", PROMPTS, 6, device, block_size=8, speculative_config=spec) == expected
