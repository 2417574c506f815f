"""`LLM(model, data_parallel_size=2)`: the offline API over two engine-core replicas (the server's
DPEngineCoreClient, driven from the LLM's own event loop). One DP LLM for the module, against a
world-size-1 LLM on the tiny Llama (float32), chunked prefill (16-token budget) and prefix caching on:
    greedy     a batch of prompts of different lengths: tokens equal, logprobs within 1e-4, in order,
               both replicas' own stats show they ran some of it
    n > 1      two samples of a seeded request, the same as world size 1's
    surface    beam_search, chat, priority + use_tqdm, reset_prefix_cache, get_tokenizer, and a call
               from inside a running event loop: as world size 1
    bad input  ValueError before anything is queued; the LLM serves the next batch
    refused    multi-node flags offline
    tp x dp    replicas of two tensor-parallel ranks: the same tokens; shutdown ends every rank
    death      kill -9 of a replica during generate: a clear error, not a hang; garbage collection
               of that LLM stops the survivor
    shutdown   no replica process outlives shutdown() (last: it ends the shared LLM)
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time

import pytest
from serve_helpers import pid_alive

from kvtide import LLM, SamplingParams
from kvtide.engine.core_client import EngineDeadError
from kvtide.sampling_params import BeamSearchParams

PROMPTS = ["a", "hello there", "the quick brown fox jumps over the lazy dog",
           "0 1 2 3 4 5 6 7 8 9 " * 4, "data parallel offline", "x y z", "one more prompt of a middling length"]
COMMON = dict(dtype="float32", max_model_len=512, kv_cache_memory="4MiB", max_num_seqs=8,
              max_num_batched_tokens=16, enable_prefix_caching=True)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
SAMPLED = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6)
BEAMS = BeamSearchParams(beam_width=2, max_tokens=5)
CHAT = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "what is data parallelism?"}]]


def _chosen_logprobs(completion) -> list[float]:
    return [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)]


def _assert_same_greedy(got, want) -> None:
    assert [o.prompt for o in got] == [o.prompt for o in want]  # in prompt order
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert _chosen_logprobs(g.outputs[0]) == pytest.approx(_chosen_logprobs(w.outputs[0]), abs=1e-4)


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _children(pid: int) -> list[int]:
    found = []
    for thread in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{thread}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, **COMMON)
    try:
        yield {"greedy": llm.generate(PROMPTS, GREEDY), "sampled": llm.generate(PROMPTS[2], SAMPLED),
               "beams": [[s.tokens for s in b.sequences] for b in llm.beam_search(PROMPTS[:3], BEAMS)],
               "chat": llm.chat(CHAT, GREEDY)}
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def dp_llm(llama_dir):
    llm = LLM(llama_dir, data_parallel_size=2, **COMMON)
    yield llm
    llm.shutdown()


def test_greedy_batch_equals_world_size_one(dp_llm, reference):
    before = [s.iteration_tokens["sum"] for s in dp_llm.engine.get_engine_stats()]
    _assert_same_greedy(dp_llm.generate(PROMPTS, GREEDY), reference["greedy"])
    after = [s.iteration_tokens["sum"] for s in dp_llm.engine.get_engine_stats()]
    # tokens each replica's own scheduler ran: both took part
    assert len(after) == 2 and all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_n_samples_equal_world_size_one(dp_llm, reference):
    assert _tokens(dp_llm.generate(PROMPTS[2], SAMPLED)) == _tokens(reference["sampled"])


def test_rest_of_the_surface_as_world_size_one(dp_llm, reference):
    assert [[s.tokens for s in b.sequences] for b in dp_llm.beam_search(PROMPTS[:3], BEAMS)] == reference["beams"]
    chat = dp_llm.chat(CHAT, GREEDY)
    assert [o.prompt_token_ids for o in chat] == [o.prompt_token_ids for o in reference["chat"]]
    assert _tokens(chat) == _tokens(reference["chat"])
    got = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=True, priority=list(range(len(PROMPTS))))
    _assert_same_greedy(got, reference["greedy"])
    assert dp_llm.get_tokenizer().decode(reference["greedy"][1].prompt_token_ids,
                                         skip_special_tokens=True) == PROMPTS[1]
    assert dp_llm.reset_prefix_cache() is True

    async def from_async_code():  # a notebook's or a server's thread already runs a loop
        return dp_llm.generate(PROMPTS[:2], GREEDY)

    _assert_same_greedy(asyncio.run(from_async_code()), reference["greedy"][:2])


def test_bad_input_is_refused_before_anything_is_queued(dp_llm, reference):
    with pytest.raises(ValueError, match="max_tokens"):
        dp_llm.generate(["fine", "also fine"], [GREEDY, SamplingParams(max_tokens=0)])
    with pytest.raises(ValueError):
        dp_llm.generate(["x" * 600], GREEDY)  # longer than max_model_len
    assert not dp_llm.engine.has_unfinished_requests()
    assert dp_llm.engine.llm.num_unfinished_requests == 0
    assert all(s.num_running == s.num_waiting == 0 for s in dp_llm.engine.get_engine_stats())
    _assert_same_greedy(dp_llm.generate(PROMPTS[:2], GREEDY), reference["greedy"][:2])  # still serving


def test_multi_node_flags_are_refused_offline(llama_dir):
    with pytest.raises(ValueError, match="replicas on other nodes join a server"):
        LLM(llama_dir, data_parallel_size=2, data_parallel_size_local=1, **COMMON)
    with pytest.raises(ValueError, match="data_parallel_start_rank"):
        LLM(llama_dir, data_parallel_size=2, data_parallel_start_rank=1, **COMMON)


def test_tensor_parallel_replicas(llama_dir, reference):
    llm = LLM(llama_dir, data_parallel_size=2, tensor_parallel_size=2, cpu_threads_per_rank=1, **COMMON)
    try:
        cores = llm.engine.engine_core_pids
        ranks = [c for p in cores for c in _children(p)]
        assert len(ranks) >= 2, ranks  # each replica's other rank(s) in processes of their own
        _assert_same_greedy(llm.generate(PROMPTS, GREEDY), reference["greedy"])
    finally:
        llm.shutdown()
    assert _wait_gone(cores + ranks) == []


def test_killed_replica_fails_generate_and_gc_leaves_no_process(llama_dir, monkeypatch):
    monkeypatch.setenv("KVTIDE_FAULT_INJECT", "sleep_s=0.02")  # each step 20 ms: the kill lands mid-batch
    llm = LLM(llama_dir, data_parallel_size=2, **COMMON)
    pids = llm.engine.engine_core_pids
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    killer = threading.Timer(1.0, lambda: os.kill(pids[1], signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(EngineDeadError, match="data-parallel replica died"):
            llm.generate([f"{i} long running" for i in range(8)],
                         SamplingParams(temperature=0, max_tokens=450, ignore_eos=True))
    finally:
        killer.join()
    assert time.monotonic() - started < 30
    with pytest.raises(EngineDeadError, match="data-parallel replica died"):
        llm.generate("after the death", GREEDY)
    assert pid_alive(pids[0])
    del llm
    gc.collect()
    assert _wait_gone(pids) == []


def test_shutdown_leaves_no_replica_process(dp_llm):
    pids = dp_llm.engine.engine_core_pids
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    dp_llm.shutdown()
    assert _wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="shut down"):
        dp_llm.generate("after shutdown", GREEDY)
