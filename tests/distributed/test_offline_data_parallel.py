"""`LLM(model, data_parallel_size=2)`: the offline API over two engine-core replicas (the server's
DPEngineCoreClient, driven from the LLM's own event loop). One DP LLM for the module, against a
world-size-1 LLM on the tiny Llama (float32), chunked prefill (16-token budget) and prefix caching on:
    greedy     a batch of prompts of different lengths: tokens equal, logprobs within 1e-4, in order,
               both replicas served some
    n > 1      two samples of a seeded request, the same as world size 1's
    bad input  ValueError before anything is queued; the LLM serves the next batch
    refused    multi-node flags offline
    death      kill -9 of a replica during generate: a clear error, not a hang
    shutdown   no replica process outlives shutdown()
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from serve_helpers import pid_alive

from kvtide import LLM, SamplingParams

PROMPTS = ["a", "hello there", "the quick brown fox jumps over the lazy dog",
           "0 1 2 3 4 5 6 7 8 9 " * 4, "data parallel offline", "x y z", "one more prompt of a middling length"]
COMMON = dict(dtype="float32", max_model_len=512, kv_cache_memory="4MiB", max_num_seqs=8,
              max_num_batched_tokens=16, enable_prefix_caching=True)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)


def _chosen_logprobs(completion) -> list[float]:
    return [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)]


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, **COMMON)
    greedy = llm.generate(PROMPTS, GREEDY)
    sampled = llm.generate(PROMPTS[2], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6))
    llm.shutdown()
    return greedy, sampled


@pytest.fixture(scope="module")
def dp_llm(llama_dir):
    llm = LLM(llama_dir, data_parallel_size=2, **COMMON)
    yield llm
    llm.shutdown()


def test_greedy_batch_equals_world_size_one(dp_llm, reference):
    outs = dp_llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS  # in prompt order
    for got, want in zip(outs, reference[0], strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        assert _chosen_logprobs(got.outputs[0]) == pytest.approx(_chosen_logprobs(want.outputs[0]), abs=1e-4)
    routed = [e["requests"] for e in dp_llm.engine.llm.engine_summaries()]
    assert len(routed) == 2 and all(r > 0 for r in routed), routed


def test_n_samples_equal_world_size_one(dp_llm, reference):
    out = dp_llm.generate(PROMPTS[2], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6))[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference[1][0].outputs]


def test_bad_input_is_refused_before_anything_is_queued(dp_llm, reference):
    with pytest.raises(ValueError, match="max_tokens"):
        dp_llm.generate(["fine", "also fine"], [GREEDY, SamplingParams(max_tokens=0)])
    with pytest.raises(ValueError):
        dp_llm.generate(["x" * 600], GREEDY)  # longer than max_model_len
    assert not dp_llm.engine.has_unfinished_requests()
    assert dp_llm.engine.llm.num_unfinished_requests == 0
    outs = dp_llm.generate(PROMPTS[:2], GREEDY)  # still serving
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference[0][:2]]


def test_multi_node_flags_are_refused_offline(llama_dir):
    with pytest.raises(ValueError, match="replicas on other nodes join a server"):
        LLM(llama_dir, data_parallel_size=2, data_parallel_size_local=1, **COMMON)
    with pytest.raises(ValueError, match="data_parallel_start_rank"):
        LLM(llama_dir, data_parallel_size=2, data_parallel_start_rank=1, **COMMON)


def test_killed_replica_fails_generate_and_shutdown_leaves_no_process(llama_dir, monkeypatch):
    monkeypatch.setenv("KVTIDE_FAULT_INJECT", "sleep_s=0.02")  # each step 20 ms: the kill lands mid-batch
    llm = LLM(llama_dir, data_parallel_size=2, **COMMON)
    pids = llm.engine.engine_core_pids
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    killer = threading.Timer(1.0, lambda: os.kill(pids[1], signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="data-parallel replica died"):
            llm.generate([f"{i} long running" for i in range(8)],
                         SamplingParams(temperature=0, max_tokens=450, ignore_eos=True))
    finally:
        killer.join()
    assert time.monotonic() - started < 30
    llm.shutdown()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids)
