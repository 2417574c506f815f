"""Sleep mode and weight updates (worker/sleep_mode.py), as RL frameworks drive them: the memory
each sleep level frees really goes back to the OS, waking gives the same greedy tokens, and new
weights (from disk or as tensors) give the new checkpoint's HF tokens with no KV of the old ones
served; a weight that does not fit changes nothing."""

from __future__ import annotations

import os

import pytest
import torch
from hf_reference import hf_greedy
from safetensors.torch import load_file

from kvtide import LLM, SamplingParams

SHAPE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
"""About 6M parameters besides the embeddings: weights big enough to see leave the process."""
KV_MEMORY = 64 * 2**20
PROMPTS = ["The weather in Paris is", "Once upon a time, a small robot"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _hf_tokens(model_dir: str) -> list[list[int]]:
    return [hf_greedy(model_dir, p, MAX_TOKENS).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def checkpoints(checkpoint_factory) -> tuple[str, str]:
    return checkpoint_factory(seed=0, **SHAPE), checkpoint_factory(seed=1, **SHAPE)


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(checkpoints[0], enable_sleep_mode=True, kv_cache_memory=str(KV_MEMORY), max_model_len=256,
               dtype="float32", device="cpu")


def test_checkpoints_differ(checkpoints):
    assert _hf_tokens(checkpoints[0]) != _hf_tokens(checkpoints[1])


def test_sleep_frees_the_kv_pool_then_the_weights_and_waking_gives_the_same_tokens(llm, checkpoints):
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == _hf_tokens(checkpoints[0])
    runner = llm.engine.core.executor.runner
    weights = sum(p.nbytes for p in runner.model.parameters())
    llm.sleep(1)  # the first sleep also hands back what loading left free in the heap: not measured
    llm.wake_up()
    awake = _rss()
    llm.sleep(1)
    assert llm.is_sleeping()
    assert awake - _rss() >= 0.9 * KV_MEMORY
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == _hf_tokens(checkpoints[0])

    awake = _rss()
    llm.sleep(2)
    assert awake - _rss() >= 0.9 * (KV_MEMORY + weights)
    llm.wake_up()
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == _hf_tokens(checkpoints[0])
    llm.engine.core.check_integrity()


def test_new_weights_give_the_new_checkpoints_tokens_and_no_old_kv(llm, checkpoints):
    first, second = checkpoints
    llm.update_weights_from_disk(first)
    warm = llm.generate(PROMPTS, GREEDY)  # fills the prefix cache under the first weights
    assert _tokens(warm) == _hf_tokens(first)
    version = llm.update_weights_from_disk(second)
    after = llm.generate(PROMPTS, GREEDY)
    assert _tokens(after) == _hf_tokens(second)
    assert all(o.num_cached_tokens == 0 for o in after)  # nothing computed under the old weights served
    tensors = load_file(os.path.join(first, "model.safetensors"))
    assert llm.collective_rpc("update_weights", (list(tensors.items()),)) == [version + 1]
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == _hf_tokens(first)


def test_weights_that_do_not_fit_change_nothing(llm, checkpoints):
    first = checkpoints[0]
    llm.update_weights_from_disk(first)
    tensors = load_file(os.path.join(first, "model.safetensors"))
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    good = [(n, t + 1.0) for n, t in tensors.items() if n != name]  # would change every other weight
    for bad in ([*good, (name, torch.zeros(3, 3))], [*good, ("model.layers.0.no_such.weight", tensors[name])]):
        with pytest.raises(ValueError, match="do not fit"):
            llm.update_weights(bad)
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == _hf_tokens(first)
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(3)


def test_sleep_mode_must_be_enabled(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep(1)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.update_weights_from_disk(llama_dir)
