"""Multi-LoRA numerics: each request's greedy tokens equal HF `generate` on its own adapter merged
into the base (`merge_and_unload`), chosen-token logprobs within 1e-4, with several adapters and
base rows in one batch, and through chunked prefill, preemption, slot and host-cache eviction and a
warm prefix cache (which never shares KV between adapters)."""

from __future__ import annotations

import pytest
from hf_reference import LONG_PROMPT, assert_greedy_and_logprobs_match_hf, hf_greedy, random_prompts
from lora_cases import ADAPTERS

from kvtide import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 10
LOGPROB_TOL = 1e-4
MAX_MODEL_LEN = 256
PROMPTS = random_prompts(6, seed=7, max_words=24) + [LONG_PROMPT[:150], "Hello"]
NAMES = list(ADAPTERS)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def make_llm(base_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "16MiB")
    kwargs.setdefault("enable_prefix_caching", False)
    kwargs.setdefault("max_lora_rank", 16)
    return LLM(base_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, enable_lora=True, **kwargs)


def lora_requests(case, names: list[str | None]) -> list[LoRARequest | None]:
    return [None if name is None else LoRARequest(name, NAMES.index(name) + 1, case.adapter_dirs[name])
            for name in names]


def assert_each_matches_its_adapter(case, prompts: list[str], names: list[str | None], outputs) -> None:
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        reference = case.base_dir if name is None else case.merged_dirs[name]
        assert_greedy_and_logprobs_match_hf(reference, [prompt], [out], MAX_TOKENS, LOGPROB_TOL)


def mixed(n: int) -> list[str | None]:
    """Three adapters and the base model, in turn."""
    return [(NAMES + [None])[i % 4] for i in range(n)]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_three_adapters_and_base_rows_in_one_batch_match_hf(lora_case_factory, architecture):
    case = lora_case_factory(architecture)
    # Each adapter changes what the model says: a test that ignored the adapters would fail.
    for name in NAMES:
        assert any(hf_greedy(case.merged_dirs[name], p, MAX_TOKENS).token_ids !=
                   hf_greedy(case.base_dir, p, MAX_TOKENS).token_ids for p in PROMPTS[:3]), name
    llm = make_llm(case.base_dir, max_loras=3)
    names = mixed(len(PROMPTS))
    steps = []
    runner = llm.engine.core.executor.runner
    begin = runner.lora.begin_step

    fused = runner.lora._fused_decode  # the compiled CPU decode layers, where this machine has them

    def spy(requests, lens):
        failed = begin(requests, lens)
        ids = {r.lora_int_id for r in requests if r is not None} | ({0} if None in requests else set())
        steps.append((ids, runner.model.fused_decode is not None))
        return failed
    runner.lora.begin_step = spy
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=lora_requests(case, names))
    assert_each_matches_its_adapter(case, PROMPTS, names, outputs)
    assert any(ids == {0, 1, 2, 3} for ids, _ in steps), "every adapter and the base shared a step"
    # The fused decode layers bypass the hooks: never on a step with adapter rows, on for the base's.
    assert not any(on for ids, on in steps if ids - {0})
    base_only = llm.generate(PROMPTS[:2], GREEDY)
    assert_each_matches_its_adapter(case, PROMPTS[:2], [None, None], base_only)
    assert steps[-1] == ({0}, fused is not None)


def test_chunked_prefill_and_slot_and_host_eviction_match_hf(lora_case_factory):
    case = lora_case_factory("LlamaForCausalLM")
    # Two slots for three adapters (a request waits for a slot), two in host memory (reloads).
    llm = make_llm(case.base_dir, max_loras=2, max_cpu_loras=2, max_num_batched_tokens=32)
    names = mixed(len(PROMPTS))
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=lora_requests(case, names))
    assert_each_matches_its_adapter(case, PROMPTS, names, outputs)
    stats = llm.engine.core.executor.lora_stats()
    assert len(stats["load_seconds"]) > len(NAMES), "an adapter evicted from host memory was loaded again"
    assert len(stats["resident"]) <= 2 and len(stats["host"]) <= 2


def test_preemption_matches_hf(lora_case_factory):
    case = lora_case_factory("LlamaForCausalLM")
    probe = make_llm(case.base_dir, kv_cache_memory="1MiB")
    block_bytes = probe.engine.core.executor.kv_bytes_per_block()
    probe.shutdown()
    num_blocks = MAX_MODEL_LEN // 16  # room for the longest request and little else
    llm = make_llm(case.base_dir, max_loras=3, kv_cache_memory=str(num_blocks * block_bytes),
                   enable_prefix_caching=True)
    prompts = PROMPTS[4:]  # the longest (100-150 tokens): two fill the pool, and their decodes overflow it
    names = mixed(len(prompts))
    outputs = llm.generate(prompts, GREEDY, lora_request=lora_requests(case, names))
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_each_matches_its_adapter(case, prompts, names, outputs)
    llm.engine.core.scheduler.kv_cache_manager.pool.check_integrity()


def test_warm_prefix_cache_is_keyed_by_adapter(lora_case_factory):
    case = lora_case_factory("LlamaForCausalLM")
    llm = make_llm(case.base_dir, max_loras=3, enable_prefix_caching=True)
    prompts = [LONG_PROMPT[:120] + tail for tail in (" and then", " or else")]
    first, second = NAMES[0], NAMES[1]
    cold = llm.generate(prompts, GREEDY, lora_request=lora_requests(case, [first, first]))
    assert_each_matches_its_adapter(case, prompts, [first, first], cold)
    # The same adapter finds its blocks; another adapter and the base model find none of them.
    warm = llm.generate(prompts, GREEDY, lora_request=lora_requests(case, [first, first]))
    assert_each_matches_its_adapter(case, prompts, [first, first], warm)
    assert all(out.num_cached_tokens >= 112 for out in warm)
    other = llm.generate(prompts[:1], GREEDY, lora_request=lora_requests(case, [second]))
    base = llm.generate(prompts[1:], GREEDY)
    assert other[0].num_cached_tokens == 0 and base[0].num_cached_tokens == 0
    assert_each_matches_its_adapter(case, prompts, [second, None], other + base)
    again = llm.generate(prompts[:1], GREEDY, lora_request=lora_requests(case, [second]))
    assert again[0].num_cached_tokens >= 112
    assert_each_matches_its_adapter(case, prompts[:1], [second], again)


QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                 norm_topk_prob=False, mlp_only_layers=[1])


def test_moe_with_attention_only_adapter_matches_hf(checkpoint_factory, tmp_path):
    from lora_cases import ATTENTION, make_peft_adapter

    base = checkpoint_factory("Qwen2MoeForCausalLM", **QWEN2_MOE)
    adapter = make_peft_adapter(base, str(tmp_path / "attn"), 8, 16, ATTENTION, False, 4, str(tmp_path / "merged"))
    prompts = PROMPTS[:2]
    assert any(hf_greedy(str(tmp_path / "merged"), p, MAX_TOKENS).token_ids != hf_greedy(base, p, MAX_TOKENS).token_ids
               for p in prompts)
    llm = make_llm(base, max_loras=1)
    lora = LoRARequest("attn", 1, adapter)
    outputs = llm.generate(prompts, GREEDY, lora_request=[lora, None])
    for prompt, reference, out in zip(prompts, [str(tmp_path / "merged"), base], outputs, strict=True):
        assert_greedy_and_logprobs_match_hf(reference, [prompt], [out], MAX_TOKENS, LOGPROB_TOL)


def test_a_slow_adapter_load_does_not_hold_the_step_loop(lora_case_factory, monkeypatch):
    """An adapter evicted from host memory reloads on the loader thread: its request waits in the
    queue while the base request keeps decoding, then runs and matches HF."""
    import threading
    import time

    from kvtide.lora import model_state

    case = lora_case_factory("LlamaForCausalLM")
    llm = make_llm(case.base_dir, max_loras=1, max_cpu_loras=1)
    slow, loads = NAMES[0], []
    real_load = model_state.load_adapter

    def slow_load(request, *args, **kwargs):
        loads.append((request.lora_name, threading.current_thread().name))
        if request.lora_name == slow and len(loads) > 2:
            time.sleep(1.0)
        return real_load(request, *args, **kwargs)
    monkeypatch.setattr(model_state, "load_adapter", slow_load)
    first, second = lora_requests(case, [slow, NAMES[1]])
    llm.engine.add_lora(first)
    llm.engine.add_lora(second)  # one host slot: the first is evicted
    steps: list[set[str]] = []
    runner = llm.engine.core.executor.runner
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda so: steps.append(set(so.num_scheduled_tokens)) or execute(so))
    many = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    llm.engine.add_request("base", "Hello", many)
    llm.engine.add_request("adapter", PROMPTS[0], GREEDY, lora_request=first)
    outputs = {o.request_id: o for o in llm._run(["base", "adapter"], use_tqdm=False)}
    assert loads[2][0] == slow and loads[2][1].startswith("kvtide-lora-load")
    first_with_adapter = next(i for i, ids in enumerate(steps) if "adapter" in ids)
    assert sum("base" in ids for ids in steps[:first_with_adapter]) >= 5  # steps went on while it loaded
    assert_each_matches_its_adapter(case, PROMPTS[:1], [slow], [outputs["adapter"]])


def test_eight_adapters_and_base_rows_in_one_batch_match_hf(lora_case_factory, tmp_path_factory):
    from lora_cases import ATTENTION, MLP, make_peft_adapter

    case = lora_case_factory("LlamaForCausalLM")
    root = tmp_path_factory.mktemp("eight")
    adapters = dict(case.adapter_dirs)
    merged = dict(case.merged_dirs)
    extra = {"r2-qv": (2, 4, ["q_proj", "v_proj"]), "r12-o-down": (12, 24, ["o_proj", "down_proj"]),
             "r16-k-up": (16, 8, ["k_proj", "up_proj"]), "r6-gate": (6, 12, ["gate_proj"]),
             "r10-all": (10, 10, ATTENTION + MLP)}
    for seed, (name, (rank, alpha, targets)) in enumerate(extra.items(), start=10):
        merged[name] = str(root / f"{name}-merged")
        adapters[name] = make_peft_adapter(case.base_dir, str(root / name), rank, alpha, targets, False, seed,
                                           merged[name])
    names = list(adapters)
    assert len(names) == 8
    prompts = random_prompts(10, seed=21, max_words=12)
    assigned = names + [None, None]
    requests = [None if n is None else LoRARequest(n, names.index(n) + 1, adapters[n]) for n in assigned]
    llm = make_llm(case.base_dir, max_loras=8)
    outputs = llm.generate(prompts, GREEDY, lora_request=requests)
    for prompt, name, out in zip(prompts, assigned, outputs, strict=True):
        assert_greedy_and_logprobs_match_hf(merged[name] if name else case.base_dir, [prompt], [out], MAX_TOKENS,
                                            LOGPROB_TOL)
    assert len(llm.engine.core.executor.lora_stats()["resident"]) == 8
