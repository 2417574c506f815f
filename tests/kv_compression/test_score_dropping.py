"""Score-based dropping (--kv-drop-policy score --kv-drop-budget F) end to end, against the same
policy written plainly on Hugging Face: HF's eager attention returns its softmax weights, which
the reference accumulates per 16-token block; before each step it drops the lowest-mass blocks
beyond the budget (sparing block 0 and the most recent half of the budget) and masks their
positions for every later query. Greedy tokens must be equal, the request's live blocks must stay
within the budget, and the pool must get every block back."""

from __future__ import annotations

import math

import pytest
import torch
from hf_masked import load_eager, masked_greedy

from kvtide import LLM, SamplingParams

BUDGET, BLOCK = 0.5, 16
PROMPT = "Heavy hitters are the tokens attention keeps coming back to, block after block. " * 2
MAX_TOKENS = 120


class PlainScorePolicy:
    def __init__(self) -> None:
        self.mass: dict[int, float] = {}
        self.dropped: set[int] = set()

    def before_step(self, num_with_kv: int) -> None:
        full = -(-num_with_kv // BLOCK)
        keep = max(2, math.ceil(BUDGET * full))
        live = [b for b in range(full) if b not in self.dropped]
        if len(live) > keep:
            spared = {0, *live[-max(1, keep // 2):]}
            order = sorted((b for b in live if b not in spared), key=lambda b: (self.mass.get(b, 0.0), b))
            self.dropped |= set(order[:len(live) - keep])

    def visible(self, p: int, n: int) -> torch.Tensor:
        j = torch.arange(n)
        kept = torch.tensor([(k // BLOCK) not in self.dropped for k in range(n)])
        return (j <= p) & kept

    def on_weights(self, weights: list[torch.Tensor]) -> None:
        per_key = sum(w.sum(dim=(0, 1)) for w in weights)  # over layers, heads and queries
        for key, m in enumerate(per_key.tolist()):
            self.mass[key // BLOCK] = self.mass.get(key // BLOCK, 0.0) + m


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory) -> str:
    return checkpoint_factory("LlamaForCausalLM", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def reference(model_dir):
    from kvtide.tokenizer import load_tokenizer

    prompt_ids = load_tokenizer(model_dir)(PROMPT).input_ids
    policy = PlainScorePolicy()
    tokens = masked_greedy(load_eager(model_dir), prompt_ids, MAX_TOKENS, policy.visible, policy.before_step,
                           policy.on_weights)
    return prompt_ids, tokens, policy


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_score_dropping_equals_the_plain_reference(model_dir, reference, backend):
    prompt_ids, expected, policy = reference
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory="8MiB",
              block_size=BLOCK, kv_drop_policy="score", kv_drop_budget=BUDGET, attention_backend=backend,
              enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt_ids},
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    manager = engine.core.scheduler.kv_cache_manager
    outputs, over_budget = [], []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        request = engine.core.scheduler.requests.get("r")
        # the prompt's blocks all exist once its prefill ran; dropping starts with the next step
        if request is not None and request.num_computed_tokens > len(prompt_ids):
            keep = max(2, math.ceil(BUDGET * -(-request.num_computed_tokens // BLOCK)))
            if manager.num_live_blocks("r") > keep + 1:  # + the block the next token may open
                over_budget.append((request.num_computed_tokens, manager.num_live_blocks("r")))
    assert list(outputs[-1].outputs[0].token_ids) == expected
    assert not over_budget
    assert len(policy.dropped) >= 5  # the policy really dropped, and outputs still matched
    manager.check_integrity()
    assert manager.pool.num_free_blocks == manager.num_blocks


def test_dropping_changes_what_full_attention_would_say(model_dir, reference):
    prompt_ids, expected, _ = reference
    full = masked_greedy(load_eager(model_dir), prompt_ids, MAX_TOKENS, lambda p, n: torch.arange(n) <= p)
    assert full != expected


def test_dropping_on_quantized_blocks_with_forks_and_preemption_leaks_nothing(model_dir):
    """int8 blocks, n=2 samples sharing the prompt, and a pool small enough to preempt: every
    request finishes with its tokens, within budget, and the pool gets every block back."""
    from kvtide.tokenizer import load_tokenizer

    probe = LLM(model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory="4MiB",
                kv_cache_dtype="int8", attention_backend="torch", enable_prefix_caching=False)
    block_bytes = probe.engine.core.executor.kv_bytes_per_block()
    del probe
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=24 * block_bytes,
              block_size=BLOCK, kv_cache_dtype="int8", kv_drop_policy="score", kv_drop_budget=BUDGET,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": load_tokenizer(model_dir)(PROMPT[:n]).input_ids} for n in (60, 100, 140)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=80, ignore_eos=True, n=2))
    assert all(len(c.token_ids) == 80 for o in outputs for c in o.outputs)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    scheduler.kv_cache_manager.check_integrity()
    assert scheduler.kv_cache_manager.pool.num_free_blocks == scheduler.kv_cache_manager.num_blocks
