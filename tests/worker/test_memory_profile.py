"""KV sizing from a profiled step (issue 6): the dummy step is the largest batch, leaves nothing
behind, and gpu_memory_utilization's arithmetic. A scripted meter stands in for CUDA's."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from kvtide import LLM, SamplingParams
from kvtide.bootstrap import _gpu_memory_meter
from kvtide.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvtide.engine_args import EngineArgs
from kvtide.sampling_params import MAX_LOGPROBS
from kvtide.worker import executor as executor_module
from kvtide.worker.memory_profile import (
    PROFILE_REQUEST_PREFIX,
    CudaMemoryMeter,
    largest_batch,
    profile_peak_activation_bytes,
)
from kvtide.worker.model_runner import ModelRunner

MiB = 2**20
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=100)


class FakeMeter:
    """A device of `total` bytes where other processes hold `others`, this process `now`; a step's
    peak is `now + activation`. Records the order of its reads."""

    def __init__(self, total: int = 100 * MiB, others: int = 10 * MiB, activation: int = 3 * MiB) -> None:
        self.total, self.others, self.activation = total, others, activation
        self.now = 0
        self.weights = 5 * MiB
        """What `now` grows by when the model loads (see the `profiled` fixture)."""
        self.events: list[str] = []

    def device_usage(self) -> tuple[int, int]:
        self.events.append("device_usage")
        return self.total - self.others - self.now, self.total

    def allocated(self) -> int:
        self.events.append("allocated")
        return self.now

    def reset_peak(self) -> None:
        self.events.append("reset_peak")

    def peak(self) -> int:
        self.events.append("peak")
        return self.now + self.activation


def engine_config(model_dir: str, **overrides) -> EngineConfig:
    return EngineArgs(model=model_dir, device="cpu", **{**ENGINE, **overrides}).create_engine_config(model_dir)


def spy_execute(runner: ModelRunner, meter: FakeMeter | None = None) -> list:
    """Record each (SchedulerOutput, ModelRunnerOutput) of runner.execute, and weak references to
    the KV caches bound while it ran."""
    calls: list = []
    execute = runner.execute

    def spy(so):
        if meter is not None:
            meter.events.append("execute")
        calls.append((so, execute(so), [weakref.ref(c) for c in runner.kv_caches]))
        return calls[-1][1]

    runner.execute = spy  # type: ignore[method-assign]
    return calls


def test_largest_batch_spreads_the_budget_over_max_num_seqs():
    def sizes(budget: int, seqs: int, max_len: int = 1024) -> list[int]:
        return largest_batch(EngineConfig(ModelConfig("m", max_model_len=max_len), CacheConfig(),
                                          SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget)))

    assert sizes(100, 8) == [13, 13, 13, 13, 12, 12, 12, 12]
    assert sizes(8192, 256) == [32] * 256
    assert sizes(5, 8) == [1] * 5  # no more requests than tokens
    assert sizes(100, 2, max_len=32) == [32, 32]  # no request longer than max_model_len


def test_profile_runs_the_largest_batch_and_samples_every_request(llama_dir):
    config = engine_config(llama_dir)
    runner = ModelRunner(config, llama_dir)
    meter = FakeMeter(activation=7 * MiB)
    meter.now = 40 * MiB
    calls = spy_execute(runner, meter)
    logit_rows = []
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: logit_rows.append(hidden.shape[0]) or compute_logits(hidden)
    sampled = []
    sampler = runner.sampler
    runner.sampler = lambda logits, md: sampled.append(md) or sampler(logits, md)

    assert profile_peak_activation_bytes(runner, config, meter) == 7 * MiB

    assert meter.events == ["reset_peak", "allocated", "execute", "peak", "execute"]
    (step, out, _), (cleanup, cleanup_out, _) = calls
    ids = [r.request_id for r in step.scheduled_new_reqs]
    assert len(ids) == 8 and all(i.startswith(PROFILE_REQUEST_PREFIX) for i in ids)
    assert step.total_num_scheduled_tokens == sum(step.num_scheduled_tokens.values()) == 100
    for req in step.scheduled_new_reqs:  # whole fresh prompts, so every request samples
        assert req.num_computed_tokens == 0
        assert step.num_scheduled_tokens[req.request_id] == req.num_prompt_tokens == len(req.token_ids)
        assert req.sampling_params.max_tokens == 1
        assert len(req.block_ids) * config.cache_config.block_size >= len(req.token_ids)
    assert len({b for r in step.scheduled_new_reqs for b in r.block_ids}) == \
        sum(len(r.block_ids) for r in step.scheduled_new_reqs)  # no block shared
    assert logit_rows == [8]
    (md,) = sampled  # every memory-hungry sampler path, each row on its own seeded generator
    assert md.all_random and md.needs_processing and md.max_num_logprobs == MAX_LOGPROBS
    assert None not in (md.top_k, md.top_p, md.min_p) and len(md.generators) == 8
    assert set(out.sampled_token_ids) == set(out.logprobs) == set(ids) and not out.failed
    assert cleanup.is_empty and cleanup.finished_req_ids == set(ids) and not cleanup_out.sampled_token_ids


def test_profile_leaves_no_dummy_state_behind(llama_dir):
    # A budget of max_num_seqs tokens: all decodes.
    config = engine_config(llama_dir, max_num_batched_tokens=8)
    runner = ModelRunner(config, llama_dir)
    calls = spy_execute(runner)

    assert profile_peak_activation_bytes(runner, config) == 0  # no meter: a warm-up only

    step = calls[0][0]
    assert step.num_scheduled_tokens == {f"{PROFILE_REQUEST_PREFIX}{i}": 1 for i in range(8)}
    assert runner.requests == {} and runner.kv_caches == []
    assert all(a.kv_cache is None and a.backend is None for a in runner.model.attention_layers())
    gc.collect()
    caches = calls[0][2]
    assert len(caches) == len(runner.model.attention_layers()) and all(c() is None for c in caches)


@pytest.fixture
def profiled(monkeypatch):
    """Engines built after this without kv_cache_memory see a CUDA-like meter on the CPU: they
    profile and size the KV pool from gpu_memory_utilization; loading the model 'allocates'
    meter.weights."""
    meter = FakeMeter()
    monkeypatch.setattr("kvtide.bootstrap._gpu_memory_meter",
                        lambda config: meter if config.cache_config.kv_cache_memory is None else None)

    class LoadingExecutor(executor_module.UniprocExecutor):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            meter.now += meter.weights

    monkeypatch.setattr(executor_module, "UniprocExecutor", LoadingExecutor)
    return meter


def test_profiled_engine_generates_what_an_unprofiled_one_does(llama_dir, profiled):
    prompts = ["Once upon a time", "hi", [5, 6, 7, 8, 9]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, top_p=0.9, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)]  # the shared generator

    with_profile = LLM(model=llama_dir, device="cpu", **ENGINE).generate(prompts, params)
    plain = LLM(model=llama_dir, device="cpu", kv_cache_memory="8MiB", **ENGINE).generate(prompts, params)
    assert profiled.events.count("peak") == 1  # the first engine profiled, the second did not

    for a, b in zip(with_profile, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].token_ids) == 12


def test_kv_pool_is_utilization_less_others_weights_and_peak(llama_dir, profiled, caplog):
    with caplog.at_level(logging.INFO, logger="kvtide.bootstrap"):
        llm = LLM(model=llama_dir, device="cpu", gpu_memory_utilization=0.5, **ENGINE)

    kv_memory = 50 * MiB - 10 * MiB - 5 * MiB - 3 * MiB
    executor = llm.engine.core.executor
    assert llm.engine.core.config.cache_config.num_blocks == kv_memory // executor.kv_bytes_per_block()
    assert executor.runner.kv_caches[0].shape[2] == kv_memory // executor.kv_bytes_per_block()
    assert profiled.events[:2] == ["device_usage", "allocated"]  # read before the weights load
    assert "gpu_memory_utilization 0.50" in caplog.text and "-> KV cache 0.03 GiB" in caplog.text


@pytest.mark.parametrize("utilization, activation", [(0.1, 3 * MiB), (0.5, 35 * MiB - 64 * 1024)])
def test_too_small_a_gpu_budget_names_gpu_memory_utilization(llama_dir, profiled, utilization, activation):
    """(0.1: nothing left at all; 0.5: 64 KiB left, two blocks, fewer tokens than max_model_len.)"""
    profiled.activation = activation
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(model=llama_dir, device="cpu", gpu_memory_utilization=utilization, **ENGINE)


def test_only_cuda_without_kv_cache_memory_profiles(llama_dir):
    def config(device: str, kv_cache_memory: int | None) -> EngineConfig:
        return EngineConfig(ModelConfig("m"), CacheConfig(kv_cache_memory=kv_cache_memory), SchedulerConfig(),
                            DeviceConfig(device=device))

    assert isinstance(_gpu_memory_meter(config("cuda", None)), CudaMemoryMeter)
    assert _gpu_memory_meter(config("cuda", 1 << 30)) is None
    assert _gpu_memory_meter(config("cpu", None)) is None
