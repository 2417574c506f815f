"""The torch backend's decode mirror (contexts kept across steps) gives what the reference backend
gives, through batches that stay, shrink, grow, get preempted, and outgrow the mirror's headroom."""

from __future__ import annotations

import pytest
import torch

import kvtide.attention.torch_backend as torch_backend
from kvtide import LLM, SamplingParams

BLOCK_BYTES = 2 * 16 * 2 * 32 * 4 * 4  # K and V, 16 tokens, 2 KV heads, head_dim 32, fp32, 4 layers
PROMPTS = [[5 + (7 * i + 3 * j) % 200 for j in range(4 + 9 * i)] for i in range(6)]


def _generate(model_dir: str, backend: str, **engine):
    llm = LLM(model_dir, attention_backend=backend, **{"max_model_len": 256, **engine})
    params = [SamplingParams(temperature=0, max_tokens=12 + 9 * i, ignore_eos=True, logprobs=2)
              for i in range(len(PROMPTS))]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    llm.engine.core.check_integrity()
    return [o.outputs[0] for o in outs], llm


@pytest.mark.parametrize("engine", [
    dict(kv_cache_memory="8MiB"),
    dict(kv_cache_memory="8MiB", max_num_batched_tokens=16),         # prefill chunks mixed with decodes
    dict(kv_cache_memory=10 * BLOCK_BYTES, max_model_len=128),       # forces preemption
], ids=["plain", "chunked", "preempting"])
def test_mirror_matches_reference(llama_dir, monkeypatch, engine):
    monkeypatch.setattr(torch_backend, "MIRROR_HEADROOM_TOKENS", 8)  # rebuild often as contexts grow
    expected, _ = _generate(llama_dir, "torch_ref", **engine)
    actual, llm = _generate(llama_dir, "torch", **engine)
    for e, a in zip(expected, actual, strict=True):
        assert a.token_ids == e.token_ids
        for token, le, la in zip(e.token_ids, e.logprobs, a.logprobs, strict=True):
            assert abs(la[token].logprob - le[token].logprob) < 1e-4
    backend = llm.engine.core.executor.runner.attention_backend
    assert backend._mirrors, "the decode mirror was never used"
    for mirror in backend._mirrors.values():  # headroom is read under the mask: it must be finite
        assert torch.isfinite(mirror.buf).all()
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 + 9 * i for i, o in enumerate(actual))
    if engine["kv_cache_memory"] == 10 * BLOCK_BYTES:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_mirror_is_built_only_for_a_batch_that_stays(llama_dir):
    """Under churn (a request joins every step) no mirror is built: it would be thrown away next
    step. Once arrivals stop, the mirror comes after MIRROR_AFTER_STEPS unchanged steps."""
    llm = LLM(llama_dir, max_model_len=256, kv_cache_memory="8MiB")
    engine = llm.engine
    backend = engine.core.executor.runner.attention_backend
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(10):
        engine.add_request(engine.next_request_id(), {"prompt_token_ids": PROMPTS[i % len(PROMPTS)]}, params)
        engine.step()
        assert not backend._mirrors, f"a mirror was built at churn step {i}"
    steps = 0
    while not backend._mirrors:
        engine.step()
        steps += 1
    assert steps == torch_backend.MIRROR_AFTER_STEPS + 1
    while engine.has_unfinished_requests():
        engine.step()
    engine.core.check_integrity()
