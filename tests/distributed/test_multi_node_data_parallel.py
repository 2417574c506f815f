"""Multi-node data parallelism, the two "nodes" being two process trees on 127.0.0.1 over TCP: a head
(`kvtide serve --data-parallel-size 2 --data-parallel-size-local 1`, rank 0 and the API) and a
headless node (`kvtide serve --headless --data-parallel-start-rank 1`, rank 1) joining it at
--data-parallel-address / --data-parallel-rpc-port. What is checked:
    flags      each bad combination refused in seconds, naming the flag, before any model loads
    greedy     a concurrent batch equals LLM.generate's (world size 1), both replicas served some
    shutdown   stopping the head stops the headless node's engine and its launcher (exit 0)
    death      kill -9 of the remote engine core: /health 503 within seconds, the head exits
    refusal    a node that joins with the wrong rank is refused by name and exits non-zero
    experts    with --enable-expert-parallel on a MoE model the two nodes' replicas share their
               experts (the group's rendezvous handed over at the join): greedy equals world size 1
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from serve_helpers import MODEL_NAME, free_port, pid_alive, start_server, wait_ready

from kvtide.engine.dp_client import check_data_parallel_args
from kvtide.engine_args import EngineArgs
from kvtide.sampling_params import SamplingParams

MAX_TOKENS = 10
PROMPTS = [f"{i} {word} across two nodes" for i, word in enumerate(["red", "green", "blue", "cyan", "gold", "lime"])]
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "4MiB", "--max-num-seqs", "8")


def _flags_error(headless: bool = False, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        check_data_parallel_args(EngineArgs(model="demo", **kwargs), headless=headless)
    return str(info.value)


def test_bad_multi_node_flags_are_refused_up_front():
    assert "data_parallel_start_rank=1 + data_parallel_size_local=2 exceeds" in _flags_error(
        data_parallel_size=2, data_parallel_size_local=2, data_parallel_start_rank=1)
    assert "data_parallel_start_rank must be in [0, data_parallel_size=2)" in _flags_error(
        data_parallel_size=2, data_parallel_start_rank=2)
    assert "is for a headless node" in _flags_error(data_parallel_size=2, data_parallel_size_local=1,
                                                    data_parallel_start_rank=1)
    assert "--headless runs some of another node's" in _flags_error(
        headless=True, data_parallel_size=2, data_parallel_size_local=1)  # start rank 0 is the head's
    assert "--headless needs --data-parallel-address" in _flags_error(
        headless=True, data_parallel_size=2, data_parallel_size_local=1, data_parallel_start_rank=1)
    assert "data_parallel_rpc_port must be a TCP port" in _flags_error(
        data_parallel_size=2, data_parallel_size_local=1, data_parallel_rpc_port=70000)
    check_data_parallel_args(EngineArgs(model="demo", data_parallel_size=2, data_parallel_size_local=1,
                                        data_parallel_address="127.0.0.1", data_parallel_start_rank=1),
                             headless=True)

    from kvtide.cli import main

    started = time.monotonic()
    assert main(["serve", "demo", "--headless", "--data-parallel-size", "2", "--data-parallel-size-local", "1"]) == 2
    assert time.monotonic() - started < 10  # refused before any engine starts


# ---- two nodes on one machine -------------------------------------------------------------------
class Node:
    """A headless node's launcher process and its log."""

    def __init__(self, model: str, rpc_port: int, start_rank: int = 1, extra: tuple[str, ...] = ()) -> None:
        self.log_path = tempfile.NamedTemporaryFile(prefix="kvtide-headless-", suffix=".log", delete=False).name
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtide.cli", "serve", model, "--headless", "--data-parallel-size", "2",
                 "--data-parallel-size-local", "1", "--data-parallel-start-rank", str(start_rank),
                 "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
                 "--max-model-len", "1024", *ENGINE_FLAGS, *extra],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log_path)


def _start_head(model: str, rpc_port: int, extra: tuple[str, ...] = ()):
    return start_server(model, "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                        "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
                        *ENGINE_FLAGS, *extra)


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[tuple[str, str]]:
    from kvtide import LLM

    llm = LLM(llama_dir, dtype="float32", max_model_len=1024, kv_cache_memory="4MiB", max_num_seqs=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    llm.shutdown()
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture
def two_nodes(llama_dir):
    rpc_port = free_port()
    node = Node(llama_dir, rpc_port)  # the headless node may start first: it waits for the head
    head = _start_head(llama_dir, rpc_port)
    try:
        wait_ready(head)
    except BaseException:
        print(node.log()[-3000:])
        node.stop()
        raise
    try:
        yield head, node
    finally:
        head.stop()
        node.stop()
        os.unlink(head.log_path)


async def _complete_all(head, prompts: list[str]) -> list[dict]:
    async with httpx.AsyncClient(base_url=head.base_url, headers=head.headers, timeout=60.0) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": MODEL_NAME, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}) for p in prompts))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0] for r in responses]


def test_remote_replica_serves_like_a_local_one_and_stops_with_the_head(two_nodes, reference):
    head, node = two_nodes
    choices = asyncio.run(_complete_all(head, PROMPTS))
    assert [(c["text"], c["finish_reason"]) for c in choices] == reference
    engines = head.stats()["data_parallel"]
    assert [e["engine"] for e in engines] == [0, 1]
    assert all(e["requests"] > 0 for e in engines), engines  # the remote replica took its share
    remote_pid = engines[1]["pid"]
    assert pid_alive(remote_pid) and remote_pid not in (head.proc.pid, engines[0]["pid"])

    assert head.stop() == 0
    node.proc.wait(30)
    assert node.proc.returncode == 0, node.log()[-3000:]
    assert not pid_alive(remote_pid)


def test_killed_remote_engine_makes_the_head_unhealthy(two_nodes):
    head, node = two_nodes
    remote_pid = head.stats()["data_parallel"][1]["pid"]
    assert httpx.get(head.url("/health"), timeout=5).status_code == 200
    os.kill(remote_pid, signal.SIGKILL)
    killed = time.monotonic()
    status = 200
    while time.monotonic() - killed < 15:
        try:
            status = httpx.get(head.url("/health"), timeout=5).status_code
        except httpx.TransportError:
            status = None  # the dead engine already took the server down
        if status != 200:
            break
        time.sleep(0.2)
    assert status != 200 and time.monotonic() - killed < 10, "the head kept answering 200 after its replica died"
    head.proc.wait(30)
    assert head.proc.returncode != 0
    node.proc.wait(30)  # the launcher follows its only engine core
    assert node.proc.returncode != 0


def test_a_node_with_a_wrong_rank_is_refused(llama_dir):
    rpc_port = free_port()
    head = _start_head(llama_dir, rpc_port)
    # A second "node" for rank 1 of a DP=2 deployment whose head waits for rank 1: wrong size.
    log_path = tempfile.NamedTemporaryFile(prefix="kvtide-headless-", suffix=".log", delete=False).name
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "kvtide.engine.core_proc", "--handshake", f"tcp://127.0.0.1:{rpc_port}",
                 "--dp-rank", "1", "--data-parallel-size", "3", "--handshake-timeout", "60", "--parent-pid",
                 str(os.getpid()), "--engine-args", "{}"], stdout=log, stderr=subprocess.STDOUT, timeout=120)
        assert proc.returncode == 1
        with open(log_path) as f:
            text = f.read()
        assert "refused rank 1: data_parallel_size 3 differs from the head's 2" in text, text
    finally:
        head.stop()
        os.unlink(log_path)
        os.unlink(head.log_path)


def test_replicas_on_two_nodes_share_their_experts(checkpoint_factory):
    from kvtide import LLM

    mixtral = checkpoint_factory("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                                 intermediate_size=96, num_hidden_layers=2)
    llm = LLM(mixtral, dtype="float32", max_model_len=1024, kv_cache_memory="4MiB", max_num_seqs=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    llm.shutdown()
    reference = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]

    rpc_port = free_port()
    node = Node(mixtral, rpc_port, extra=("--enable-expert-parallel",))
    head = _start_head(mixtral, rpc_port, extra=("--enable-expert-parallel",))
    try:
        wait_ready(head)
        choices = asyncio.run(_complete_all(head, PROMPTS))
        assert [(c["text"], c["finish_reason"]) for c in choices] == reference
        assert all(e["requests"] > 0 for e in head.stats()["data_parallel"])
        assert head.stop() == 0
        node.proc.wait(30)
        assert node.proc.returncode == 0, node.log()[-3000:]
        assert "joined the expert-parallel group of 2 data-parallel replicas as rank 1" in node.log()
        assert "joined the expert-parallel group of 2 data-parallel replicas as rank 0" in head.log()
    finally:
        head.stop()
        node.stop()
        os.unlink(head.log_path)
