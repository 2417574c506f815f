"""`--distributed-executor-backend ray`: a tensor-parallel replica whose rank 1 is a Ray actor.

A real local Ray cluster (4 logical CPUs, no dashboard) is started once for the module and shut
down after it. What is checked:
    greedy       LLM(tensor_parallel_size=2, ray) on the tiny Llama: tokens equal world size 1's,
                 logprobs within 1e-4; the actor sits in the replica's placement group
    killed       ray.kill of the worker actor: the next generate raises WorkerDiedError at once,
                 and shutdown frees the placement group
    bad config   more CPUs than the cluster has: a ValueError before anything is reserved
    own cluster  a process with no cluster to join starts a small local one (in a subprocess, its
                 own RAY_TMPDIR), runs pipeline_parallel_size=2 on it (the last stage's tokens
                 relayed to the first) equal to world size 1, and stops it at shutdown
    server       `kvtide serve --tensor-parallel-size 2 --distributed-executor-backend ray` joins
                 the running cluster (RAY_ADDRESS), serves, and answers /health 503 within
                 seconds of its actor being killed; the cluster gets its CPUs back
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

# Ray reads this when imported: a single-node cluster then binds every server to 127.0.0.1 (by
# default its GCS and raylet listen on all interfaces under the node's address).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray  # noqa: E402
from serve_helpers import MODEL_NAME, pid_alive, start_server, wait_ready

from kvtide import LLM  # noqa: E402
from kvtide.sampling_params import SamplingParams  # noqa: E402
from kvtide.worker.multiproc_executor import WorkerDiedError  # noqa: E402
from kvtide.worker.ray_executor import ACTOR_NAME_PREFIX, RayExecutor, _running_cluster_address  # noqa: E402

CLUSTER_CPUS = 4
PROMPTS = ["The Ray executor places", "tensor parallel ranks", "on a cluster of nodes, one actor each"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
LOGPROB_TOLERANCE = 1e-4
TP_ARGS = dict(tensor_parallel_size=2, distributed_executor_backend="ray", cpu_threads_per_rank=1,
               kv_cache_memory="8MiB")


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.1)


def _cpus_free() -> bool:
    return ray.available_resources().get("CPU", 0.0) == CLUSTER_CPUS


def _kvtide_groups() -> list[dict]:
    return [g for g in ray.util.placement_group_table().values() if g["name"].startswith("kvtide-")]


@pytest.fixture(scope="module")
def ray_cluster():
    address_before = os.environ.pop("RAY_ADDRESS", None)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False, object_store_memory=100 * 2**20,
             log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if address_before is not None:
            os.environ["RAY_ADDRESS"] = address_before


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Built first: the process group of a multi-rank LLM is this process's while it lives."""
    llm = LLM(model=llama_dir, kv_cache_memory="8MiB")
    try:
        yield llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def ray_llm(ray_cluster, llama_dir, reference):
    llm = LLM(model=llama_dir, **TP_ARGS)
    try:
        yield llm
    finally:
        llm.shutdown()


def _executor(llm: LLM) -> RayExecutor:
    executor = llm.engine.core.executor
    assert isinstance(executor, RayExecutor)
    return executor


# ---- without a replica -----------------------------------------------------------------------------
def test_a_stale_cluster_record_is_ignored(monkeypatch, tmp_path):
    """ray.init would wait minutes on an address `ray start` left behind; we start our own instead."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    started = time.monotonic()
    assert _running_cluster_address() is None
    assert time.monotonic() - started < 5


# ---- the offline LLM ------------------------------------------------------------------------------
def test_greedy_tokens_and_logprobs_equal_world_size_1(ray_llm, reference):
    executor = _executor(ray_llm)
    before = executor.comm_stats()  # a message both ways through the actor
    outputs = ray_llm.generate(PROMPTS, GREEDY)
    for ref, out in zip(reference, outputs, strict=True):
        ref_c, out_c = ref.outputs[0], out.outputs[0]
        assert out_c.token_ids == ref_c.token_ids
        assert len(out_c.token_ids) == GREEDY.max_tokens
        for ref_pos, out_pos, token in zip(ref_c.logprobs, out_c.logprobs, out_c.token_ids, strict=True):
            assert abs(out_pos[token].logprob - ref_pos[token].logprob) <= LOGPROB_TOLERANCE

    assert len(executor.actors) == 1 and len(executor.weight_bytes_per_rank) == 2
    assert executor.weight_bytes_per_rank[0] == executor.weight_bytes_per_rank[1] > 0
    group = ray.util.placement_group_table(executor.placement_group)
    assert group["state"] == "CREATED" and group["strategy"] == "PACK"
    assert [b["CPU"] for b in group["bundles"].values()] == [1.0, 1.0]
    # Rank 0's counters live in this process, which earlier tests' in-process groups may have counted
    # into; the calls during this generate are what both ranks must agree on.
    after = executor.comm_stats()
    assert set(before) == set(after) == {0, 1}
    calls = [after[r]["tp.all_reduce"]["calls"] - before[r].get("tp.all_reduce", {}).get("calls", 0)
             for r in (0, 1)]
    assert calls[0] == calls[1] > 0


def test_more_cpus_than_the_cluster_is_a_value_error(ray_cluster, llama_dir):
    groups_before = len(_kvtide_groups())
    with pytest.raises(ValueError, match=r"required CPUs exceeds the total number of available CPUs.*"
                                         r"needs 6 CPUs \(3 per rank\), the cluster has 4"):
        LLM(model=llama_dir, **dict(TP_ARGS, cpu_threads_per_rank=3))
    assert len(_kvtide_groups()) == groups_before  # nothing reserved
    assert ray.is_initialized()  # not our executor's cluster to stop


def test_killed_actor_fails_the_next_step(ray_llm):
    """Runs last of the LLM tests: the replica is dead after it."""
    executor = _executor(ray_llm)
    group = executor.placement_group
    ray.kill(executor.actors[0])
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1 died"):
        ray_llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - started < 10
    ray_llm.shutdown()
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    _wait_for(_cpus_free, 10, "CPUs given back")


_OWN_CLUSTER_SCRIPT = """
import json, sys
import ray
from kvtide import LLM
from kvtide.sampling_params import SamplingParams
llm = LLM(model=sys.argv[1], pipeline_parallel_size=2, distributed_executor_backend="ray", cpu_threads_per_rank=1,
          kv_cache_memory="8MiB")
outputs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=12, logprobs=1,
                                                               ignore_eos=True))
store = ray.cluster_resources().get("object_store_memory")
llm.shutdown()
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outputs],
                  "logprobs": [[p[t].logprob for p, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                               for o in outputs],
                  "object_store_memory": store, "ray_after_shutdown": ray.is_initialized()}))
"""


def test_without_a_cluster_the_executor_starts_and_stops_its_own(llama_dir, reference):
    temp = tempfile.mkdtemp(prefix="kvray-", dir="/tmp")  # Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=temp, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, "-c", _OWN_CLUSTER_SCRIPT, llama_dir, json.dumps(PROMPTS)], env=env,
                              capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == [r.outputs[0].token_ids for r in reference]
    for ref, logprobs in zip(reference, result["logprobs"], strict=True):
        expected = [p[t].logprob for p, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) <= LOGPROB_TOLERANCE
    assert result["object_store_memory"] == 100 * 2**20
    assert result["ray_after_shutdown"] is False


# ---- the server --------------------------------------------------------------------------------------
def test_server_joins_the_cluster_and_dies_with_its_actor(ray_cluster, llama_dir, reference):
    _wait_for(_cpus_free, 10, "free cluster")
    server = start_server(llama_dir, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
                          "--cpu-threads-per-rank", "1", "--kv-cache-memory", "8MiB",
                          env={"RAY_ADDRESS": ray_cluster})
    try:
        wait_ready(server)
        body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": GREEDY.max_tokens, "temperature": 0,
                "ignore_eos": True}
        with server.client() as client:
            response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == reference[0].outputs[0].text
        assert ray.available_resources().get("CPU", 0.0) == CLUSTER_CPUS - 2  # the replica's two bundles

        names = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(ACTOR_NAME_PREFIX)]
        assert len(names) == 1 and names[0]["name"].endswith("-rank1")
        ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]))
        started = time.monotonic()
        _wait_for(lambda: httpx.get(server.url("/health"), timeout=5).status_code == 503, 10, "/health 503")
        assert time.monotonic() - started < 10
        _wait_for(lambda: not pid_alive(server.engine_pid), 10, "engine core exit")
        _wait_for(_cpus_free, 30, "the replica's CPUs back in the cluster")
    finally:
        server.stop()
    assert not pid_alive(server.engine_pid)
