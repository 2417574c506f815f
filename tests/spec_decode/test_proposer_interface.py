"""The proposer interface: every method SpeculativeConfig accepts has a Proposer class in the registry,
the engine builds it from there and proposes through ProposerInput, and a proposer reads requests
through RequestView only (a plain object with those fields serves as well as the runner's state)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import pytest
from test_heads import (
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    TARGET_LAYERS,
    Eagle1Reference,
    Eagle3Reference,
    medusa_tensors,
    write_checkpoint,
)

from kvtide import LLM, SamplingParams
from kvtide.sampling_params import SamplingParams as Params
from kvtide.spec_decode.config import METHODS, parse_speculative_config
from kvtide.spec_decode.ngram import NgramProposer
from kvtide.spec_decode.proposer import DraftSlots, Proposer, ProposerInput
from kvtide.spec_decode.registry import PROPOSERS, proposer_class

MAX_MODEL_LEN = 64
PROMPTS = ["abc abc abc abc", "1 2 3 1 2 3 1 2 3", "draft tokens"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@dataclass
class PlainRequest:
    """A RequestView that is not the runner's CachedRequestState."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    uid: int = 1
    num_prompt_tokens: int = 0
    sampling_params: Params = field(default_factory=lambda: Params(temperature=0))


def test_every_configurable_method_has_a_proposer_class():
    assert set(PROPOSERS) == set(METHODS)
    for method in METHODS:
        cls = proposer_class(method)
        assert issubclass(cls, Proposer) and not inspect.isabstract(cls), method


def test_an_unknown_method_is_an_error_before_any_model_loads():
    with pytest.raises(ValueError, match="method must be one of .*ngram.*got 'lookahead'"):
        parse_speculative_config({"method": "lookahead", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'lookahead' is not available.*available: ngram"):
        proposer_class("lookahead")


def test_ngram_proposes_from_a_plain_request_view():
    proposer = NgramProposer(1, 3)
    rows = [DraftSlots(PlainRequest("a", [5, 6, 7, 8, 5, 6], 5, [0]), 2),  # suffix 5 6 seen at 0: then 7 8
            DraftSlots(PlainRequest("b", [1, 2, 3, 4], 3, [1]), 3),  # nothing recurs
            DraftSlots(PlainRequest("c", [9, 4, 9, 4, 9], 4, [2]), 5)]  # 9 4 9 at 0: then 4 9 (the end)
    assert proposer.propose(ProposerInput(rows)) == {"a": [7, 8], "b": [], "c": [4, 9]}


@pytest.fixture(scope="module")
def target_dir(checkpoint_factory) -> str:
    """The 8-layer Llama of test_heads.py (EAGLE-3 reads three of its layers)."""
    return checkpoint_factory("LlamaForCausalLM", seed=0, hidden_size=HIDDEN, intermediate_size=INTER,
                              num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS,
                              num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reference(target_dir) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in make_llm(target_dir).generate(PROMPTS, GREEDY)]


def make_llm(model_dir: str, spec: dict | None = None) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="4MiB",
               speculative_config=spec)


def method_config(method: str, target_dir: str, tmp_path_factory) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(target_dir).vocab_size
    extra: dict = {"ngram": {}, "layer_skip": {"num_layers": 2}, "draft_model": {"model": target_dir}}.get(method, {})
    path = tmp_path_factory.mktemp(method)
    if method == "medusa":
        extra["model"] = write_checkpoint(path, {"medusa_num_heads": 3, "medusa_num_layers": 1},
                                          medusa_tensors(3, 1, vocab, seed=1))
    elif method == "eagle":
        extra["model"] = Eagle1Reference(seed=10).write(path)
    elif method == "eagle3":
        extra["model"] = Eagle3Reference(seed=30, target_vocab=vocab).write(path)
    return {"method": method, "num_speculative_tokens": 3, "adaptive": False, "disable_by_batch_size": 8, **extra}


@pytest.fixture(scope="module")
def engines(target_dir, tmp_path_factory):
    """method -> its LLM, built once for this module."""
    built: dict[str, LLM] = {}

    def get(method: str) -> LLM:
        if method not in built:
            built[method] = make_llm(target_dir, method_config(method, target_dir, tmp_path_factory))
        return built[method]

    return get


@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_the_engine_builds_each_method_from_the_registry_and_proposes_through_the_interface(
        method, engines, reference):
    llm = engines(method)
    worker = llm.engine.core.executor.runner.spec
    assert type(worker.proposer) is proposer_class(method)
    calls: list[tuple[dict[str, int], dict[str, list[int]]]] = []
    propose = worker.proposer.propose

    def recording(batch: ProposerInput) -> dict[str, list[int]]:
        # x, the token to continue, is the one request token the target has not computed yet
        assert all(len(request.token_ids) == request.num_computed_tokens + 1 for request, _ in batch.rows)
        drafts = propose(batch)
        calls.append(({request.request_id: k for request, k in batch.rows}, drafts))
        return drafts

    worker.proposer.propose = recording
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == reference
    assert any(any(drafts.values()) for _, drafts in calls), f"{method} proposed nothing"
    for slots, drafts in calls:
        assert all(1 <= k <= 3 for k in slots.values())
        assert all(req_id in slots and len(d) <= slots[req_id] for req_id, d in drafts.items())
    stats = llm.engine.core.get_stats().spec_decoding
    assert stats["num_draft_tokens"] == sum(len(d) for _, drafts in calls for d in drafts.values())


def test_a_draft_model_proposes_for_a_plain_request_view(engines, reference):
    """The target as its own draft proposes the target's greedy continuation, here for a request the
    runner never saw (its KV written into free blocks of the draft's cache)."""
    llm = engines("draft_model")
    prompt = llm.generate(PROMPTS[:1], GREEDY)[0].prompt_token_ids
    proposer = llm.engine.core.executor.runner.spec.proposer
    request = PlainRequest("plain", list(prompt), len(prompt) - 1,
                           list(range(1, 2 + (len(prompt) + 3) // proposer.block_size)), num_prompt_tokens=len(prompt))
    assert proposer.propose(ProposerInput([DraftSlots(request, 3)])) == {"plain": reference[0][:3]}
    assert request.token_ids == prompt  # read, not written
