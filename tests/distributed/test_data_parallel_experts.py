"""Data-parallel replicas sharing their experts (`--data-parallel-size 2 --enable-expert-parallel`,
vLLM's DP + EP): each replica holds half of every MoE layer's experts, tokens travel to the replica
holding their experts and back (all-to-all over the replicas' gloo group), and the replicas step in
lockstep, an idle one entering the exchanges with no tokens. What is checked:
    layer     the dispatcher across replicas, each rank with its own tokens (none, one, several),
              equals the world-size-1 layer on those tokens
    engine    greedy tokens and logprobs of a concurrent batch equal world size 1; both replicas ran
              every exchange the same number of times; a lone request (the other replica idle)
              completes, the idle replica taking part with dummy passes
    refused   replicas of several ranks, a dense model: one clear error each
"""

from __future__ import annotations

import asyncio
import queue
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from kvtide import LLM, SamplingParams
from kvtide.engine.async_llm import AsyncLLM
from kvtide.engine_args import EngineArgs

MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96, num_hidden_layers=2)
PROMPTS = ["one two three", "the quick brown fox", "hello there", "alpha beta gamma delta", "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
LAYER_TOKENS = [(5, 0), (0, 3), (1, 17), (0, 0)]
"""Tokens of rank 0 and rank 1 in each call."""


# ---- the layer -----------------------------------------------------------------------------------
def _layer_worker(rank: int, port: int, results) -> None:
    try:
        torch.set_num_threads(1)
        from kvtide.distributed import destroy_distributed, init_replica_expert_group
        from kvtide.layers.moe.layer import FusedMoE

        torch.manual_seed(0)
        w13, w2 = torch.randn(8, 2 * 96, 64) / 8, torch.randn(8, 64, 96) / 8
        reference = FusedMoE(8, 2, 64, 96)  # built before joining: one rank, every expert
        reference.w13_weight.data.copy_(w13)
        reference.w2_weight.data.copy_(w2)
        init_replica_expert_group(rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=60)
        layer = FusedMoE(8, 2, 64, 96)
        assert layer.local_num_experts == 4 and layer.dispatcher is not None
        for slot, expert in enumerate(layer.local_experts):
            layer.w13_weight.data[slot].copy_(w13[expert])
            layer.w2_weight.data[slot].copy_(w2[expert])
        errors = []
        for call, sizes in enumerate(LAYER_TOKENS):
            generator = torch.Generator().manual_seed(100 * call + rank)
            hidden = torch.randn(sizes[rank], 64, generator=generator)
            logits = torch.randn(sizes[rank], 8, generator=generator)
            out = layer(hidden, logits)
            expected = reference(hidden, logits)
            errors.append((tuple(out.shape), tuple(expected.shape),
                           (out - expected).abs().max().item() if out.numel() else 0.0))
        sent = sum(layer.dispatcher.bytes.values())
        destroy_distributed()
        results.put((rank, errors, sent))
    except BaseException:
        results.put((rank, traceback.format_exc(), 0))


def test_dispatch_across_replicas_equals_world_size_one_on_each_replicas_tokens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_layer_worker, args=(rank, port, results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        reports = {}
        for _ in procs:
            rank, errors, sent = results.get(timeout=120)
            assert not isinstance(errors, str), errors
            reports[rank] = (errors, sent)
    except queue.Empty:
        pytest.fail("a rank did not report within 120 s (an exchange one rank never entered?)")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, (errors, sent) in reports.items():
        for (shape, expected_shape, error), sizes in zip(errors, LAYER_TOKENS, strict=True):
            assert shape == expected_shape == (sizes[rank], 64)
            assert error < 1e-5, (rank, sizes, error)
        assert sent > 0  # rows really travelled


# ---- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral_dir(checkpoint_factory) -> str:
    return checkpoint_factory("MixtralForCausalLM", **MIXTRAL)


def _engine_args(model: str, **kwargs) -> EngineArgs:
    return EngineArgs(model=model, dtype="float32", kv_cache_memory="4MiB", max_model_len=512,
                      enable_prefix_caching=True, max_num_batched_tokens=16, **kwargs)


def test_replicas_sharing_experts_equal_world_size_one(mixtral_dir):
    reference_llm = LLM(mixtral_dir, dtype="float32", kv_cache_memory="4MiB", max_model_len=512)
    reference = reference_llm.generate(PROMPTS, GREEDY)
    reference_llm.shutdown()

    async def run():
        llm = await AsyncLLM.from_engine_args(_engine_args(mixtral_dir, data_parallel_size=2,
                                                           enable_expert_parallel=True), startup_timeout_s=180)
        try:
            tokens: dict[str, list[int]] = {}
            logprobs: dict[str, list[float]] = {}

            async def one(i: int, prompt: str, tag: str):
                key = f"{tag}-{i}"
                async for out in llm.generate(prompt, GREEDY, key):
                    completion = out.outputs[0]
                    tokens.setdefault(key, []).extend(completion.token_ids)
                    logprobs.setdefault(key, []).extend(
                        step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True))

            await asyncio.gather(*(one(i, p, "batch") for i, p in enumerate(PROMPTS)))
            batch_stats = await llm.client.call_utility_each("comm_stats")
            steps_before = await llm.client.call_utility_each("num_steps")
            await one(0, PROMPTS[0], "alone")
            steps_after = await llm.client.call_utility_each("num_steps")
            alone_stats = await llm.client.call_utility_each("comm_stats")
            summaries = llm.engine_summaries()
            return tokens, logprobs, batch_stats, alone_stats, steps_before, steps_after, summaries
        finally:
            llm.shutdown()

    tokens, logprobs, batch_stats, alone_stats, before, after, summaries = asyncio.run(run())
    for i, ref in enumerate(reference):
        assert tokens[f"batch-{i}"] == list(ref.outputs[0].token_ids), i
        ref_logprobs = [step[t].logprob for step, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids,
                                                           strict=True)]
        assert logprobs[f"batch-{i}"] == pytest.approx(ref_logprobs, abs=1e-4)
    assert tokens["alone-0"] == list(reference[0].outputs[0].token_ids)
    assert all(s["requests"] > 0 for s in summaries), summaries  # both replicas served the batch

    calls = [s["dp_ep.all_to_all"]["calls"] for s in batch_stats]
    assert calls[0] == calls[1] > 0  # every exchange entered by both replicas
    # The lone request ran on one replica; the other took no step of its own but entered each of
    # its exchanges (dummy passes), so both counts grew alike.
    ran = [a - b for a, b in zip(after, before, strict=True)]
    assert sorted(ran)[0] == 0 and sorted(ran)[1] > 0, ran
    grown = [a["dp_ep.all_to_all"]["calls"] - b["dp_ep.all_to_all"]["calls"]
             for a, b in zip(alone_stats, batch_stats, strict=True)]
    assert grown[0] == grown[1] > 0, grown


def test_sharing_experts_refuses_what_it_cannot_run(mixtral_dir, llama_dir):
    async def start(args):
        llm = await AsyncLLM.from_engine_args(args, startup_timeout_s=120)
        llm.shutdown()

    with pytest.raises(ValueError, match="replicas of one rank each"):
        asyncio.run(start(_engine_args(mixtral_dir, data_parallel_size=2, enable_expert_parallel=True,
                                       tensor_parallel_size=2, cpu_threads_per_rank=1)))
    with pytest.raises(ValueError, match="applies to mixture-of-experts models"):
        asyncio.run(start(_engine_args(llama_dir, data_parallel_size=2, enable_expert_parallel=True)))
