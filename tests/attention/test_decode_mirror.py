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
    monkeypatch.setattr(torch_backend, "MIRROR_HEADROOM_TOKENS", 8)  # reallocate often as contexts grow
    expected, _ = _generate(llama_dir, "torch_ref", **engine)
    actual, llm = _generate(llama_dir, "torch", **engine)
    for e, a in zip(expected, actual, strict=True):
        assert a.token_ids == e.token_ids
        for token, le, la in zip(e.token_ids, e.logprobs, a.logprobs, strict=True):
            assert abs(la[token].logprob - le[token].logprob) < 1e-4
    backend = llm.engine.core.executor.runner.attention_backend
    assert backend._mirrors, "the decode mirror was never used"
    for mirror in backend._mirrors.values():  # headroom is read under the mask: it must be finite
        assert torch.isfinite(mirror.keys_t).all() and torch.isfinite(mirror.values).all()
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 + 9 * i for i, o in enumerate(actual))
    if engine["kv_cache_memory"] == 10 * BLOCK_BYTES:
        assert llm.engine.core.scheduler.num_preemptions > 0


CHURN_PROMPTS = [[3 + (11 * i + 5 * j) % 250 for j in range(5 + 7 * (i % 5))] for i in range(14)]


def _churn(model_dir: str, backend: str, arrivals_per_step: list[int]) -> tuple[dict, LLM]:
    """A request (or several) joins at each step while earlier ones end at different lengths, as on
    a busy server; returns each request's (token ids, logprobs)."""
    llm = LLM(model_dir, attention_backend=backend, max_model_len=256, kv_cache_memory="8MiB",
              enable_prefix_caching=False)
    engine = llm.engine
    done: dict[str, tuple] = {}
    prompts = iter(enumerate(CHURN_PROMPTS))
    step = 0
    while True:
        for _ in range(arrivals_per_step[step] if step < len(arrivals_per_step) else 0):
            i, prompt = next(prompts, (None, None))
            if prompt is not None:
                params = SamplingParams(temperature=0, max_tokens=6 + (len(prompt) * 3) % 17,
                                        ignore_eos=True, logprobs=2)
                engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, [
                    {t: round(lp.logprob, 4) for t, lp in d.items()} for d in out.outputs[0].logprobs])
        step += 1
        if step >= len(arrivals_per_step) and not engine.has_unfinished_requests():
            break
    engine.core.check_integrity()
    return done, llm


@pytest.mark.parametrize("max_holes", [1000, 0], ids=["slots-kept", "compacted-often"])
def test_churn_matches_reference_and_copies_each_context_once(llama_dir, monkeypatch, max_holes):
    """Under churn the mirror is used from the first decode step, and each layer copies a
    request's context from the paged cache only when it starts decoding (slots kept), or on every
    compaction (MAX_HOLES 0: a few holes force one)."""
    monkeypatch.setattr(torch_backend, "MAX_HOLES", max_holes)
    arrivals = [1, 0, 2, 1, 0, 0, 3, 1, 1, 0, 2, 1, 1, 1]
    expected, _ = _churn(llama_dir, "torch_ref", arrivals)

    gathered_rows: list[int] = []
    real_gather = torch_backend.TorchAttentionBackend._gather

    def counting_gather(self, kv_cache, block_ids):
        gathered_rows.append(block_ids.shape[0])
        return real_gather(self, kv_cache, block_ids)

    monkeypatch.setattr(torch_backend.TorchAttentionBackend, "_gather", counting_gather)
    actual, llm = _churn(llama_dir, "torch", arrivals)
    assert actual.keys() == expected.keys() and len(actual) == len(CHURN_PROMPTS)
    for rid, (tokens, logprobs) in expected.items():
        assert actual[rid][0] == tokens
        for le, la in zip(logprobs, actual[rid][1], strict=True):
            assert le.keys() == la.keys() and all(abs(le[t] - la[t]) <= 2e-4 for t in le)
    layers = len(llm.engine.core.executor.runner.model.attention_layers())
    if max_holes == 1000:  # each request's context copied once per layer, when it starts decoding
        assert sum(gathered_rows) == layers * len(CHURN_PROMPTS)
    else:
        assert sum(gathered_rows) > layers * len(CHURN_PROMPTS)


def test_mirror_shrinks_after_a_burst(llama_dir):
    """40 short requests and one long one decode together; once the 40 are done the mirror is
    reallocated to fit the one (memory given back), and the long request's tokens and logprobs
    still equal the reference backend's."""
    prompts = [[7 + (5 * i + j) % 200 for j in range(6 + i % 5)] for i in range(41)]

    def run(backend: str):
        llm = LLM(llama_dir, attention_backend=backend, max_model_len=256, kv_cache_memory="16MiB")
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=40 if i == 40 else 4, ignore_eos=True, logprobs=2)
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        slots_seen, result = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id == "r40":
                    result = out.outputs[0]
            mirrors = getattr(llm.engine.core.executor.runner.attention_backend, "_mirrors", {})
            slots_seen.append(max((m.values.shape[0] for m in mirrors.values()), default=0))
        engine.core.check_integrity()
        return result, slots_seen

    expected, _ = run("torch_ref")
    actual, slots_seen = run("torch")
    assert max(slots_seen) >= 41  # the burst had a slot per request
    assert slots_seen[-1] <= 1 + 8  # and gave them back: one row plus the usual 8 spare slots
    assert actual.token_ids == expected.token_ids and len(actual.token_ids) == 40
    for token, le, la in zip(expected.token_ids, expected.logprobs, actual.logprobs, strict=True):
        assert abs(la[token].logprob - le[token].logprob) < 1e-4


def test_mirror_never_outgrows_the_paged_cache(llama_dir, monkeypatch):
    """The mirror is memory on top of the KV pool: a layer's mirror larger than the layer's paged
    cache is not kept (with the small-pool floor lifted), and decodes gather instead, with the
    reference backend's outputs."""
    engine = dict(kv_cache_memory=40 * BLOCK_BYTES)  # 640 tokens a layer; the mirror would want ~2,000
    expected, _ = _generate(llama_dir, "torch_ref", **engine)
    _, llm = _generate(llama_dir, "torch", **engine)
    assert llm.engine.core.executor.runner.attention_backend._mirrors  # under the floor: mirrored
    monkeypatch.setattr(torch_backend, "MIRROR_MIN_BYTES", 0)
    actual, llm = _generate(llama_dir, "torch", **engine)
    assert not llm.engine.core.executor.runner.attention_backend._mirrors
    for e, a in zip(expected, actual, strict=True):
        assert a.token_ids == e.token_ids
        for token, le, la in zip(e.token_ids, e.logprobs, a.logprobs, strict=True):
            assert abs(la[token].logprob - le[token].logprob) < 1e-4
