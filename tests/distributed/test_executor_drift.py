"""The two distributed executors run the same step logic: a pipeline-parallel MoE replica reports the
same expert load whether its second stage is a spawned process (multiproc) or a Ray actor.

Each stage counts only its own layers' routing, so the report the engine keeps must merge the first
stage's counts (rank 0, in the engine's process) with the last stage's (the output rank's message).
What is checked on a tiny two-layer Mixtral, one layer per stage: multiproc's report names both
layers and counts top_k assignments per token the model ran, and Ray's report and tokens equal it.
"""

from __future__ import annotations

import os

import pytest

# Ray reads this when imported: a single-node cluster then binds every server to 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray  # noqa: E402

from kvtide import LLM, SamplingParams  # noqa: E402

MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96, num_hidden_layers=2)
TOP_K = MIXTRAL["num_experts_per_tok"]
PROMPTS = ["one stage counts", "and so does the other"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PP_ARGS = dict(pipeline_parallel_size=2, cpu_threads_per_rank=1, kv_cache_memory="4MiB", max_model_len=256)


@pytest.fixture(scope="module")
def mixtral_dir(checkpoint_factory) -> str:
    return checkpoint_factory("MixtralForCausalLM", **MIXTRAL)


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local cluster with a CPU per rank, joined by the Ray executor (not ours to stop)."""
    address_before = os.environ.pop("RAY_ADDRESS", None)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        if address_before is not None:
            os.environ["RAY_ADDRESS"] = address_before


def _run(model_dir: str, backend: str) -> tuple[list[list[int]], list[int], dict]:
    """Greedy tokens, prompt lengths and the engine's expert load of one replica (shut down after:
    the process group of a multi-rank LLM is this process's while it lives)."""
    llm = LLM(model=model_dir, distributed_executor_backend=backend, **PP_ARGS)
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
        load = llm.engine.core.get_stats().expert_load
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs], [len(o.prompt_token_ids) for o in outputs], load


def test_ray_pipeline_reports_the_expert_load_multiproc_does(mixtral_dir, ray_cluster):
    mp_tokens, prompt_lens, mp_load = _run(mixtral_dir, "mp")
    # Every token the model ran (the prompts, then each sampled token but the last) took top_k
    # experts in each layer of each stage.
    ran = sum(prompt_lens) + len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert mp_load["layers"] == [0, 1]
    assert [sum(row) for row in mp_load["tokens"]] == [ran * TOP_K] * 2

    ray_tokens, _, ray_load = _run(mixtral_dir, "ray")
    assert ray_tokens == mp_tokens
    assert ray_load == mp_load
