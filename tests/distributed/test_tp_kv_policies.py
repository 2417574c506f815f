"""Score-based KV dropping and layer groups on tensor- and pipeline-parallel replicas (real
multi-process replicas: gloo on 127.0.0.1, one thread per rank), against world size 1 with the
same engine arguments: greedy tokens equal, chosen-token logprobs within 1e-4.

Dropping (tiny Llama, budget 0.5): every step's attention mass per block (ModelRunnerOutput.
kv_block_mass, what the scheduler's choice reads) equals world size 1's, though a TP rank holds half
the heads and a PP stage half the layers, and the blocks dropped (CachedRequestData.
dropped_block_indices, what every rank masks) are the same ones. TP=2 runs with 32-token prefill
chunks (drops between chunks); PP=2 needs whole prompts, and a chunked one is refused.

Layer groups (tiny Qwen2 alternating full and 24-token windowed layers, so under PP=2 each stage
holds one layer of each group and half world size 1's bytes per block): 32-token chunks, a warm
prefix cache, a pool small enough that freed blocks are reused, and rank 0's free blocks
overwritten with a large constant after every step; the windowed group holds only its window's
blocks at world size 2 as well.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtide import LLM, SamplingParams
from kvtide.engine_args import EngineArgs
from kvtide.kv_cache.hybrid import HybridKVCacheManager, plan_kv_cache_groups, stage_slots

BLOCK = 16
WINDOW = 24
LOGPROB_TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
TEXT = ("Heavy hitters are the tokens attention keeps coming back to, block after block, while the pool of "
        "blocks grows as sequences grow and the scheduler gives each request a budget of tokens. ")
DROP_PROMPTS = [TEXT, TEXT[:70], TEXT[40:150]]
HYBRID_PROMPTS = [TEXT * 2, TEXT[:90], "Hello"]
SHARED = TEXT[:120]
"""Asked alone after HYBRID_PROMPTS, then extended: the extension finds its blocks in the prefix cache."""
QWEN2_ALTERNATING = dict(use_sliding_window=True, sliding_window=WINDOW, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024,
                         layer_types=["full_attention", "sliding_attention"] * 2)

STEP = 32
"""Tokens per step where prompts are chunked."""
NUM_BLOCKS = 56
DROP_CASES = {"tp2-chunked": (dict(tensor_parallel_size=2), dict(max_num_batched_tokens=STEP)),
              "pp2-whole-prompts": (dict(pipeline_parallel_size=2), dict(enable_chunked_prefill=False))}
PARALLEL = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}


@pytest.fixture(scope="module")
def drop_dir(checkpoint_factory) -> str:
    return checkpoint_factory("LlamaForCausalLM", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def hybrid_dir(checkpoint_factory) -> str:
    """initializer_range 0.3 (0.2 by default): attention weighs enough that a layer reading another
    group's table moves most logprobs past the tolerance."""
    return checkpoint_factory("Qwen2ForCausalLM", initializer_range=0.3, **QWEN2_ALTERNATING)


def make_llm(model_dir: str, parallel: dict, **kwargs) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=512, block_size=BLOCK,
               cpu_threads_per_rank=1, **parallel, **kwargs)


class Trace:
    """What the engine core saw each step, recorded from the scheduler's update (the contract
    between execution and policy): mass and drops per request, and after the update each running
    request's live blocks per layer group."""

    def __init__(self, llm: LLM, poison: bool = False) -> None:
        self.llm = llm
        self.mass: dict[str, list[list[float]]] = {}
        self.drops: dict[str, list[int]] = {}
        self.live: dict[str, list[list[int]]] = {}
        self.reused: set[int] = set()
        """Blocks held again after a request gave them back."""
        self._held: set[int] = set()
        self._freed: set[int] = set()
        scheduler = llm.engine.core.scheduler
        update = scheduler.update_from_output

        def observed(scheduler_output, runner_output):
            for cached in scheduler_output.scheduled_cached_reqs:
                self.drops.setdefault(cached.request_id, []).extend(cached.dropped_block_indices)
            for req_id, mass in runner_output.kv_block_mass.items():
                self.mass.setdefault(req_id, []).append(mass)
            outputs = update(scheduler_output, runner_output)
            self._after_step(scheduler.kv_cache_manager, poison)
            return outputs

        scheduler.update_from_output = observed

    def _after_step(self, manager, poison: bool) -> None:
        if isinstance(manager, HybridKVCacheManager):
            for req_id in manager.req_to_blocks:
                self.live.setdefault(req_id, []).append([m.num_live_blocks(req_id) for m in manager.managers])
        held = {b.block_id for b in manager.pool.blocks if b.ref_cnt > 0}
        self.reused |= held & self._freed
        self._freed |= self._held - held
        self._held = held
        free = [b.block_id for b in manager.pool.blocks if b.ref_cnt == 0 and b.block_hash is None]
        if poison and free:  # a block freed while a layer of rank 0 still reads it changes the tokens
            for cache in self.llm.engine.core.executor.runner.kv_caches:
                cache.index_fill_(list(cache.shape).index(manager.num_blocks), torch.tensor(free), 30.0)


def generate(llm: LLM, prompts: list[str]) -> list[dict]:
    """Per prompt: greedy tokens, each chosen token's logprob, prompt length, prefix-cache hit."""
    return [dict(tokens=o.outputs[0].token_ids, prompt_len=len(o.prompt_token_ids), cached=o.num_cached_tokens,
                 logprobs=[entry[t].logprob for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                               strict=True)], request_id=o.request_id)
            for o in llm.generate(prompts, GREEDY)]


def assert_same_outputs(got: list[dict], expected: list[dict], label: str) -> None:
    for i, (out, ref) in enumerate(zip(got, expected, strict=True)):
        assert out["tokens"] == ref["tokens"], f"{label} prompt {i}"
        assert out["logprobs"] == pytest.approx(ref["logprobs"], abs=LOGPROB_TOL), f"{label} prompt {i}"


def check_pool_returned(llm: LLM) -> None:
    manager = llm.engine.core.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.pool.num_used_blocks == 0


# ---- score-based dropping ----------------------------------------------------------------------------
def run_drop(model_dir: str, parallel: dict, engine: dict):
    llm = make_llm(model_dir, parallel, kv_cache_memory="8MiB", enable_prefix_caching=False,
                   kv_drop_policy="score", kv_drop_budget=0.5, **engine)
    try:
        trace = Trace(llm)
        outputs = generate(llm, DROP_PROMPTS)
        check_pool_returned(llm)
        assert llm.engine.core.scheduler.num_preemptions == 0  # a recomputed request forgets its drops
        return outputs, trace
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", list(DROP_CASES))
def test_score_dropping_equals_world_size_one(drop_dir, case):
    parallel, engine = DROP_CASES[case]
    expected, ref = run_drop(drop_dir, {}, engine)
    got, trace = run_drop(drop_dir, parallel, engine)
    assert_same_outputs(got, expected, case)
    assert trace.drops == ref.drops
    assert sum(len(d) for d in ref.drops.values()) >= 8  # the policy really dropped
    assert trace.mass.keys() == ref.mass.keys()
    for req_id, steps in ref.mass.items():
        assert len(trace.mass[req_id]) == len(steps), req_id
        for step, (mass, ref_mass) in enumerate(zip(trace.mass[req_id], steps, strict=True)):
            assert mass == pytest.approx(ref_mass, rel=1e-4, abs=1e-5), f"{case} {req_id} step {step}"


def test_chunked_prompts_under_pipeline_dropping_are_refused(drop_dir):
    with pytest.raises(ValueError) as info:
        EngineArgs(model=drop_dir, pipeline_parallel_size=2, cpu_threads_per_rank=1, kv_drop_policy="score",
                   kv_drop_budget=0.5, enable_prefix_caching=False).create_engine_config(drop_dir)
    assert "--no-enable-chunked-prefill" in str(info.value)


# ---- layer groups ------------------------------------------------------------------------------------
def test_each_stage_binds_slots_for_its_own_layers():
    """Full layers 0 and 3, windowed 1, 2, 4, 5: groups (0, 3), (1, 2), (4, 5) of two layers. A stage
    of layers 0-2 needs two slots (layers 1 and 2 of one group), as does one of layers 3-5."""
    groups = plan_kv_cache_groups([None, 8, 8, None, 8, 8])
    assert [g.layers for g in groups] == [(0, 3), (1, 2), (4, 5)]
    assert stage_slots(groups, range(6)) == {0: (0, 0), 3: (0, 1), 1: (1, 0), 2: (1, 1), 4: (2, 0), 5: (2, 1)}
    assert stage_slots(groups, range(0, 3)) == {0: (0, 0), 1: (1, 0), 2: (1, 1)}
    assert stage_slots(groups, range(3, 6)) == {3: (0, 0), 4: (2, 0), 5: (2, 1)}
    # alternating full and windowed layers over two stages: one layer of each group per stage
    alternating = plan_kv_cache_groups([None, 8, None, 8])
    assert stage_slots(alternating, range(2, 4)) == {2: (0, 0), 3: (1, 0)}


def layer_bytes_per_block(kv_heads: int) -> int:
    """One layer's float32 K and V for a block, from the model's shape (head_dim 64 / 4 heads)."""
    head_dim = QWEN2_ALTERNATING["hidden_size"] // QWEN2_ALTERNATING["num_attention_heads"]
    return BLOCK * 2 * kv_heads * head_dim * 4


def run_hybrid(model_dir: str, parallel: dict, bytes_per_block: int):
    """The prompts together, then one sharing a long prefix with the last, which hits it in every
    group. A pool of NUM_BLOCKS: room for the first round at its longest, fewer than it takes over
    time, so blocks the window freed are handed out again."""
    llm = make_llm(model_dir, parallel, kv_cache_memory=str(NUM_BLOCKS * bytes_per_block),
                   enable_prefix_caching=True, max_num_batched_tokens=STEP)
    try:
        assert isinstance(llm.engine.core.scheduler.kv_cache_manager, HybridKVCacheManager)
        assert llm.engine.core.executor.kv_bytes_per_block() == bytes_per_block
        assert llm.engine.core.config.cache_config.num_blocks == NUM_BLOCKS
        trace = Trace(llm, poison=True)
        outputs = generate(llm, HYBRID_PROMPTS) + generate(llm, [SHARED]) + generate(llm, [SHARED + " and then"])
        check_pool_returned(llm)
        return outputs, trace
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def hybrid_reference(hybrid_dir):
    """World size 1: a block holds two layers of a group (S = 2)."""
    return run_hybrid(hybrid_dir, {}, 2 * layer_bytes_per_block(kv_heads=2))


@pytest.mark.parametrize("case", list(PARALLEL))
def test_layer_groups_equal_world_size_one(hybrid_dir, hybrid_reference, case):
    expected, _ = hybrid_reference
    # per rank: TP=2 caches one of the two KV heads of both layers of a group; a PP=2 stage both
    # heads of its one layer of each group
    per_block = 2 * layer_bytes_per_block(kv_heads=1) if case == "tp2" else layer_bytes_per_block(kv_heads=2)
    got, trace = run_hybrid(hybrid_dir, PARALLEL[case], per_block)
    assert_same_outputs(got, expected, case)
    assert got[-1]["cached"] == expected[-1]["cached"] >= 96  # the last found its prefix in every group
    assert trace.reused, "no freed block was handed out again"
    long = got[0]
    full = [held[0] for held in trace.live[long["request_id"]]]
    windowed = [held[1] for held in trace.live[long["request_id"]]]
    # the full group holds every block of the request, as one table would; the windowed group only
    # what a step of STEP tokens reads (the window, the step and a partial block at each end)
    assert max(full) >= math.ceil(long["prompt_len"] / BLOCK)
    assert max(windowed) <= math.ceil((WINDOW + STEP + BLOCK - 2) / BLOCK) < max(full)
