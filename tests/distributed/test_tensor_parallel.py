"""Tensor and pipeline parallel replicas beyond their numbers (those are in
tests/models/test_parallel_parity.py): bad configurations refused up front, each rank holding its
share of the weights, the collectives' volume per step against the communication model, requests
a replica cannot serve refused, and a dead rank ending the engine (offline: the next step raises;
server: /health 503 within seconds).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from serve_helpers import launch_server, pid_alive

from kvtide import LLM, SamplingParams
from kvtide.distributed import config_checks
from kvtide.engine_args import EngineArgs
from kvtide.sampling_params import StructuredOutputsParams
from kvtide.worker.multiproc_executor import WorkerDiedError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONSTRAINED = SamplingParams(temperature=0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"]))


def config_error(model_dir: str, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        EngineArgs(model=model_dir, **kwargs).create_engine_config(model_dir)
    return str(info.value)


# ---- bad configurations: one clear error each, before any process starts -------------------------
def test_bad_parallel_configs(checkpoint_factory, llama_dir, monkeypatch):
    # the tiny Llama: 4 query heads, 2 KV heads, 4 layers
    assert "attention heads (4)" in config_error(llama_dir, tensor_parallel_size=3, cpu_threads_per_rank=1)
    wide = checkpoint_factory("LlamaForCausalLM", hidden_size=192, num_attention_heads=12, num_key_value_heads=6)
    assert "KV heads (6)" in config_error(wide, tensor_parallel_size=4, cpu_threads_per_rank=1)
    odd = checkpoint_factory("LlamaForCausalLM", hidden_size=192, num_attention_heads=12, num_key_value_heads=3)
    assert "not a multiple" in config_error(odd, tensor_parallel_size=4, cpu_threads_per_rank=1)
    assert "exceeds the model's layers (4)" in config_error(llama_dir, pipeline_parallel_size=5,
                                                            cpu_threads_per_rank=1)
    assert "mixture-of-experts" in config_error(llama_dir, enable_expert_parallel=True)
    assert "tensor_parallel_size must be an integer >= 1" in config_error(llama_dir, tensor_parallel_size=0)
    assert "distributed_executor_backend" in config_error(llama_dir, tensor_parallel_size=2,
                                                          distributed_executor_backend="threads")
    assert "cpu_threads_per_rank" in config_error(llama_dir, tensor_parallel_size=2, cpu_threads_per_rank=0)
    mlp320 = checkpoint_factory("LlamaForCausalLM", intermediate_size=320)  # int4 g64 fits 320, not a rank's 160
    assert "tensor_parallel_size=2 = 160" in config_error(mlp320, tensor_parallel_size=2, quantization="int4",
                                                          quantization_group_size=64, cpu_threads_per_rank=1)
    assert "'layer_skip' does not combine with pipeline parallelism" in config_error(
        llama_dir, pipeline_parallel_size=2, cpu_threads_per_rank=1,
        speculative_config={"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 1})
    assert "data_parallel_size_local" in config_error(llama_dir, data_parallel_size=2, data_parallel_size_local=3)
    # tensor-parallel experts split each expert's intermediate dimension: 97 rows do not halve
    mixtral = checkpoint_factory("MixtralForCausalLM", intermediate_size=97)
    assert "expert intermediate size (97)" in config_error(mixtral, tensor_parallel_size=2, cpu_threads_per_rank=1)
    monkeypatch.setattr(config_checks, "usable_cpus", lambda: 1)
    message = config_error(llama_dir, tensor_parallel_size=2)
    assert "needs at least 2 CPUs" in message and "1 are usable" in message
    # sharing cores is allowed when asked for
    EngineArgs(model=llama_dir, tensor_parallel_size=2, cpu_threads_per_rank=1).create_engine_config(llama_dir)


def test_world_size_one_builds_no_process_group(llama_dir):
    import torch.distributed as dist

    config = EngineArgs(model=llama_dir).create_engine_config(llama_dir)
    assert config.parallel_config.world_size == 1
    assert config.parallel_config.distributed_executor_backend == "uni"
    llm = LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=512)
    try:
        llm.generate(["hello"], GREEDY)
        assert not dist.is_initialized()
        assert type(llm.engine.core.executor).__name__ == "UniprocExecutor"
    finally:
        llm.shutdown()


# ---- weights and communication ---------------------------------------------------------------------
def test_tp2_shards_weights_and_counts_its_collectives(checkpoint_factory):
    model_dir = checkpoint_factory("LlamaForCausalLM")  # hidden 128, 4 layers, an odd vocabulary (padded)
    whole = LLM(model_dir, kv_cache_memory="4MiB", max_model_len=512)
    whole_bytes = whole.engine.core.executor.runner.weight_bytes
    expected = whole.generate(["the quick brown fox"], GREEDY)[0].outputs[0].token_ids
    expected_constrained = whole.generate(["answer:"], CONSTRAINED)[0].outputs[0].text
    hf = whole.engine.core.config.model_config.hf_config
    whole.shutdown()

    llm = LLM(model_dir, kv_cache_memory="4MiB", max_model_len=512, tensor_parallel_size=2, cpu_threads_per_rank=1)
    try:
        executor = llm.engine.core.executor
        per_rank = executor.weight_bytes_per_rank
        assert len(per_rank) == 2
        norms = (2 * hf.num_hidden_layers + 1) * hf.hidden_size * 4  # RMSNorm weights: on every rank
        table = hf.vocab_size * hf.hidden_size * 4  # the embedding, and the untied LM head
        rank_table = -(-hf.vocab_size // 2) * hf.hidden_size * 4  # half the vocabulary, padded to a whole row
        for rank_bytes in per_rank:
            assert rank_bytes == (whole_bytes - norms - 2 * table) // 2 + norms + 2 * rank_table
        before = executor.comm_stats()
        prompt = "a prompt of a few words"
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
        after = executor.comm_stats()
        num_tokens = len(out.prompt_token_ids)
        for rank in (0, 1):
            def delta(kind, field, rank=rank):
                return after[rank].get(kind, {}).get(field, 0) - before[rank].get(kind, {}).get(field, 0)
            # one step: the embedding's all-reduce and two per layer (o_proj, down_proj), each of
            # T x hidden float32, of which a ring all-reduce sends 2(n-1)/n = 1 times the size
            assert delta("tp.all_reduce", "calls") == 1 + 2 * hf.num_hidden_layers
            assert delta("tp.all_reduce", "bytes") == (1 + 2 * hf.num_hidden_layers) * num_tokens * hf.hidden_size * 4
            # the sampled row's logits: each rank sends its half of the padded vocabulary
            assert delta("tp.all_gather", "calls") == 1
            assert delta("tp.all_gather", "bytes") == -(-hf.vocab_size // 2) * 4
        assert llm.generate(["the quick brown fox"], GREEDY)[0].outputs[0].token_ids == expected
        # the grammar masks rank 0's logits only; rank 1 takes its tokens
        constrained = llm.generate(["answer:"], CONSTRAINED)[0].outputs[0].text
        assert constrained == expected_constrained and constrained in ("yes", "no", "maybe so")
        assert llm.generate(["the quick brown fox"], GREEDY)[0].outputs[0].token_ids == expected
    finally:
        llm.shutdown()


def test_pp2_stages_split_the_model_and_die_with_a_worker(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=512, pipeline_parallel_size=2, cpu_threads_per_rank=1)
    try:
        executor = llm.engine.core.executor
        # each stage holds half the layers; the first the embedding, the last the LM head
        first, last = executor.weight_bytes_per_rank
        runner = executor.runner
        assert runner.model.embed_tokens is not None and runner.model.lm_head is None
        assert len(runner.model.attention_layers()) == 2
        assert abs(first - last) < 0.05 * (first + last)
        before = executor.comm_stats()
        out = llm.generate(["stage to stage"], SamplingParams(temperature=0, max_tokens=1))[0]
        after = executor.comm_stats()
        sent = after[0]["pp.send"]["bytes"] - before[0].get("pp.send", {}).get("bytes", 0)
        assert sent == 2 * len(out.prompt_token_ids) * 128 * 4  # hidden states and residual, float32
        assert llm.generate(["still serving"], GREEDY)[0].outputs[0].token_ids
        with pytest.raises(ValueError, match="process group is live"):  # a second engine beside this one
            LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=512)

        executor.workers[0].kill()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            llm.generate(["after the worker died"], GREEDY)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    return found


def test_server_reports_dead_when_a_tp_worker_dies(llama_dir):
    server = launch_server(llama_dir, "--tensor-parallel-size", "2", "--cpu-threads-per-rank", "1",
                           "--kv-cache-memory", "8MiB")
    try:
        with server.client() as client:
            r = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hello", "max_tokens": 4,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
        workers = _children(server.engine_pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        status = 200
        while time.monotonic() < deadline and status == 200:
            time.sleep(0.25)
            try:
                status = httpx.get(server.url("/health"), timeout=5.0).status_code
            except httpx.TransportError:
                status = -1  # the server went down with its engine: also not healthy
        assert status != 200, "still healthy 10 s after a worker rank died"
        assert status in (503, -1)
        server.proc.wait(timeout=30)
        assert not pid_alive(server.engine_pid)
    finally:
        server.stop()
