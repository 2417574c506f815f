"""`kvtide serve --data-parallel-size 2`: two engine-core replicas behind one API server.

One real server on the tiny Llama (float32), started once for the module; its last test kills a
replica, so the server is gone after it. What is checked:
    greedy       outputs of a concurrent batch equal LLM.generate's (world size 1), and both
                 replicas served some of it (per-replica stats in /internal/stats and /metrics)
    n > 1        the samples of one request run on one replica
    prefix       a shared-prefix workload (one request after another) lands on one replica, whose
                 prefix cache then hits
    abort        a client that walks away frees its request on the replica that held it
    metrics      /metrics sums the replicas
    death        kill -9 of one replica: /health 503 within seconds, streams in flight end with
                 engine_dead, the server exits non-zero and no engine core outlives it
Plus, without processes: the flags refused up front, the CPU/GPU split
between replicas and the stats merge.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from serve_helpers import MODEL_NAME, pid_alive, sse_events, start_server, wait_ready

from kvtide.engine.dp_client import check_data_parallel_args, merge_stats  # noqa: E402
from kvtide.engine.dp_placement import plan_replicas  # noqa: E402
from kvtide.engine.messages import SchedulerStats  # noqa: E402
from kvtide.engine_args import EngineArgs  # noqa: E402
from kvtide.sampling_params import SamplingParams  # noqa: E402

CMPL = "/v1/completions"
MAX_TOKENS = 12
PROMPTS = [f"{i} {word} data parallel prompt number {i}" for i, word in
           enumerate(["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"])]


# ---- without processes ---------------------------------------------------------------------------
def test_bad_data_parallel_flags_are_refused_up_front():
    with pytest.raises(ValueError, match="data_parallel_size_local must be in"):
        check_data_parallel_args(EngineArgs(model="demo", data_parallel_size=2, data_parallel_size_local=3))
    with pytest.raises(ValueError, match="data_parallel_size must be"):
        check_data_parallel_args(EngineArgs(model="demo", data_parallel_size=0))
    check_data_parallel_args(EngineArgs(model="demo", data_parallel_size=2, data_parallel_size_local=2))

    from kvtide.cli import main

    started = time.monotonic()
    assert main(["serve", "demo", "--data-parallel-size", "2", "--data-parallel-size-local", "3"]) == 2
    assert time.monotonic() - started < 10  # refused before any engine starts


def test_replicas_split_the_cpus_and_gpus():
    cpu = plan_replicas(2, "cpu", cpus=[0, 1, 2, 3, 4])
    assert [p.cpu_affinity for p in cpu] == [[0, 1], [2, 3]] and [p.cpu_threads for p in cpu] == [2, 2]
    assert [p.cpu_threads for p in plan_replicas(2, "cpu", cpus=[0, 1, 2, 3], omp_threads=1)] == [1, 1]
    assert [p.cpu_threads for p in plan_replicas(2, "cpu", cpus=[0, 1, 2, 3], cpu_threads_per_rank=3)] == [3, 3]
    shared = plan_replicas(3, "cpu", cpus=[0, 1])
    assert [p.cpu_affinity for p in shared] == [None] * 3 and [p.cpu_threads for p in shared] == [1] * 3
    # A multi-rank replica gets its slice and splits it between its ranks itself.
    assert [p.cpu_threads for p in plan_replicas(2, "cpu", world_size=2, cpus=list(range(8)))] == [None, None]
    gpu = plan_replicas(2, "cuda", world_size=2, visible_gpus=["0", "1", "2", "3"])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in gpu] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="need 4 GPUs; 3 are visible"):
        plan_replicas(2, "cuda", world_size=2, visible_gpus=["0", "1", "2"])


def test_merge_stats_sums_the_replicas():
    a = SchedulerStats(num_running=2, num_waiting=1, num_used_blocks=10, num_blocks=100, prefix_cache_queries=50,
                       prefix_cache_hits=20, spec_decoding={"num_drafts": 1, "accepted_per_pos": [1, 0]})
    b = SchedulerStats(num_running=1, num_used_blocks=30, num_blocks=100, prefix_cache_queries=10,
                       spec_decoding={"num_drafts": 2, "accepted_per_pos": [2, 1]})
    m = merge_stats([a, b])
    assert (m.num_running, m.num_waiting, m.num_blocks, m.prefix_cache_queries, m.prefix_cache_hits) == \
        (3, 1, 200, 60, 20)
    assert m.kv_cache_usage == pytest.approx(0.2)
    assert m.spec_decoding == {"num_drafts": 3, "accepted_per_pos": [3, 1]}
    assert m.expert_load is None and merge_stats([a]) is a


# ---- one DP=2 server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp_server(llama_dir):
    # A 10 ms floor per step keeps the last test's 400-token streams running well past a replica's
    # death (detected within 3 s); on a fast machine a stream could otherwise end before it.
    handle = start_server(llama_dir, "--data-parallel-size", "2", "--dtype", "float32", "--kv-cache-memory", "4MiB",
                          "--max-num-seqs", "8", env={"KVTIDE_FAULT_INJECT": "sleep_s=0.01"})
    try:
        yield handle
    finally:
        handle.stop()
        for pid in getattr(handle, "engine_pids", []):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        os.unlink(handle.log_path)


@pytest.fixture(scope="module")
def offline(llama_dir, dp_server):
    """World-size-1 greedy outputs of PROMPTS (computed while the server starts), then the ready server."""
    from kvtide import LLM

    llm = LLM(llama_dir, dtype="float32", max_model_len=512, kv_cache_memory="4MiB", max_num_seqs=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    reference = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    del llm
    wait_ready(dp_server)
    dp_server.engine_pids = dp_server.stats()["engine_core_pids"]
    return reference


def _engines(server) -> list[dict]:
    return server.stats()["data_parallel"]


def _wait_idle(server, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        if stats["num_unfinished_requests"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0 and \
                all(e["num_requests"] == 0 and e["num_waiting"] == 0 for e in stats["data_parallel"]):
            return stats
        assert time.monotonic() < deadline, f"still busy: {stats}"
        time.sleep(0.05)


async def _complete_all(server, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=120.0) as client:
        responses = await asyncio.gather(*(client.post(CMPL, json=b) for b in bodies))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def test_greedy_batch_equals_offline_and_uses_both_replicas(dp_server, offline):
    assert len(dp_server.engine_pids) == 2 and len(set(dp_server.engine_pids)) == 2
    before = _engines(dp_server)
    bodies = [{"model": MODEL_NAME, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0} for p in PROMPTS]
    results = asyncio.run(_complete_all(dp_server, bodies))
    got = [(r["choices"][0]["text"], r["choices"][0]["finish_reason"]) for r in results]
    assert got == offline
    after = _engines(dp_server)
    routed = [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)]
    assert sum(routed) == len(PROMPTS) and all(n > 0 for n in routed), routed
    # Each replica's own scheduler saw prompts: not only the balancer's bookkeeping.
    assert all(a["stats"]["prefix_cache_queries"] > b["stats"]["prefix_cache_queries"]
               for a, b in zip(after, before, strict=True))
    _wait_idle(dp_server)


def test_n_samples_stay_on_one_replica(dp_server, offline):
    before = _engines(dp_server)
    body = {"model": MODEL_NAME, "prompt": "four samples of one request", "max_tokens": 8, "n": 4,
            "temperature": 0.8, "seed": 7}
    (result,) = asyncio.run(_complete_all(dp_server, [body]))
    assert len(result["choices"]) == 4
    after = _engines(dp_server)
    routed = [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)]
    assert sorted(routed) == [0, 1]
    engine = routed.index(1)
    queried = [a["stats"]["prefix_cache_queries"] - b["stats"]["prefix_cache_queries"]
               for a, b in zip(after, before, strict=True)]
    assert queried[1 - engine] == 0 and queried[engine] > 0
    _wait_idle(dp_server)
    # Beam search (beams forked in the core): one replica, and every beam's request leaves the
    # balancer's count when it ends (_wait_idle checks the per-replica counts are back to 0).
    before = _engines(dp_server)
    body = {"model": MODEL_NAME, "prompt": "beams of one request", "max_tokens": 6, "n": 3, "use_beam_search": True}
    (result,) = asyncio.run(_complete_all(dp_server, [body]))
    assert len(result["choices"]) == 3
    after = _engines(dp_server)
    assert sorted(a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)) == [0, 1]
    _wait_idle(dp_server)


def test_shared_prefix_workload_lands_on_one_replica(dp_server, offline):
    prefix = "A long shared system prompt that every request of this workload starts with, " * 2
    assert len(prefix) >= 64  # 4+ KV blocks of the byte tokenizer's tokens
    before = _engines(dp_server)
    bodies = [{"model": MODEL_NAME, "prompt": f"{prefix}question {i}?", "max_tokens": 4, "temperature": 0}
              for i in range(4)]
    for body in bodies:  # one after another, as a conversation's turns or a client's loop send them
        asyncio.run(_complete_all(dp_server, [body]))
    after = _engines(dp_server)
    routed = [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)]
    assert sorted(routed) == [0, 4], routed
    engine = routed.index(4)
    assert after[engine]["affinity_requests"] - before[engine]["affinity_requests"] == 3
    hits = after[engine]["stats"]["prefix_cache_hits"] - before[engine]["stats"]["prefix_cache_hits"]
    assert hits >= 3 * 64, hits  # each request after the first found the prefix cached
    _wait_idle(dp_server)


def test_abandoned_stream_is_aborted_on_its_replica(dp_server, offline):
    body = {"model": MODEL_NAME, "prompt": "a stream the client leaves", "max_tokens": 400, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with dp_server.client() as c, c.stream("POST", CMPL, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first chunk: it runs on a replica; leave
    stats = _wait_idle(dp_server)
    assert stats["num_used_blocks"] == 0
    assert httpx.post(dp_server.url("/internal/check_integrity"), headers=dp_server.headers,
                      timeout=30).json() == {"ok": True}


def test_metrics_sum_the_replicas(dp_server, offline):
    stats = dp_server.stats()
    text = httpx.get(dp_server.url("/metrics"), headers=dp_server.headers, timeout=30).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    label = f'model_name="{MODEL_NAME}"'
    per_engine = [e["stats"] for e in stats["data_parallel"]]
    assert values[f"kvtide:kv_cache_blocks_total{{{label}}}"] == sum(s["num_blocks"] for s in per_engine)
    assert values[f"kvtide:prefix_cache_queries_total{{{label}}}"] == sum(s["prefix_cache_queries"] for s in per_engine)
    for engine in (0, 1):
        routed = values[f'kvtide:data_parallel_requests_total{{engine="{engine}",{label}}}']
        assert routed == stats["data_parallel"][engine]["requests"] > 0
        assert values[f'kvtide:data_parallel_engine_running{{engine="{engine}",{label}}}'] == 0
    # Per-engine series do not end like the totals (clients sum every series ending so).
    assert [n for n in values if n.split("{")[0].endswith(("num_requests_running", "prefix_cache_hits_total"))] == \
        [f"kvtide:num_requests_running{{{label}}}", f"kvtide:prefix_cache_hits_total{{{label}}}"]


def test_killing_one_replica_kills_the_engine(dp_server, offline):
    """Last: the server is gone afterwards."""
    server = dp_server
    body = {"model": MODEL_NAME, "prompt": "stream through a replica's death", "max_tokens": 400,
            "ignore_eos": True, "stream": True, "temperature": 0}

    async def scenario() -> tuple[float, list[list]]:
        started = asyncio.Event()
        seen = 0

        async def one(client: httpx.AsyncClient, i: int) -> list:
            nonlocal seen
            lines: list[str] = []
            async with client.stream("POST", CMPL, json={**body, "prompt": f"{i} {body['prompt']}"},
                                     timeout=60.0) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and not lines:
                        seen += 1
                        if seen == 4:
                            started.set()
                    lines.append(line)
            return sse_events(lines)

        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers) as client:
            task = asyncio.gather(*(one(client, i) for i in range(4)))
            await asyncio.wait_for(started.wait(), 60)
            os.kill(server.engine_pids[1], signal.SIGKILL)
            killed = time.monotonic()
            async with httpx.AsyncClient() as probe:
                while (await probe.get(server.url("/health"), timeout=2.0)).status_code != 503:
                    assert time.monotonic() - killed < 5, "/health still 200 five seconds after the kill"
                    await asyncio.sleep(0.02)
            return time.monotonic() - killed, await asyncio.wait_for(task, 30)

    to_unhealthy, streams = asyncio.run(scenario())
    assert to_unhealthy < 3, to_unhealthy
    for events in streams:  # on either replica: the engine as a whole is dead
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["error"]["code"] == "engine_dead", events[-2]
    assert server.proc.wait(30) not in (0, None)
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in server.engine_pids):
        assert time.monotonic() < deadline, "an engine core outlived the server"
        time.sleep(0.05)
    assert "data-parallel engine 1" in server.log()
