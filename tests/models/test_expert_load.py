"""Expert load and the capacity cap through the engine, on a tiny Mixtral.

With --moe-capacity-factor C each expert takes at most ceil(C * T * top_k / E) of a step's T tokens'
assignments; the skipped ones are counted. In one prefill step, layer 0's routing is the model's
own (nothing before it was capped), so its skips follow from HF's routing by hand.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hf_reference import hf_model_and_tokenizer, hf_prompt_ids
from test_hf_parity import GREEDY, MAX_TOKENS, PROMPTS, make_llm

from kvtide.engine import core as engine_core
from kvtide.engine.expert_load import ExpertLoadStats, imbalance, summarize

MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96)
EXPERTS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def mixtral_dir(checkpoint_factory):
    return checkpoint_factory("MixtralForCausalLM", **MIXTRAL)


def hf_layer0_counts(model_dir: str, prompt_ids: list[int]) -> list[int]:
    model, _ = hf_model_and_tokenizer(model_dir)
    picked = {}

    def keep(module, args, out) -> None:
        picked.setdefault("ids", out[2])

    hook = model.model.layers[0].mlp.gate.register_forward_hook(keep)
    try:
        with torch.inference_mode():
            model(torch.tensor([prompt_ids]))
    finally:
        hook.remove()
    return torch.bincount(picked["ids"].flatten(), minlength=EXPERTS).tolist()


def test_capacity_cap_skips_what_exceeds_it(mixtral_dir):
    factor = 0.5
    prompt_ids = hf_prompt_ids(mixtral_dir, PROMPTS[2])
    llm = make_llm(mixtral_dir, moe_capacity_factor=factor)
    llm.generate([{"prompt_token_ids": prompt_ids}], GREEDY.clone(max_tokens=1))  # one prefill step
    load = llm.engine.core.get_stats().expert_load
    counts = hf_layer0_counts(mixtral_dir, prompt_ids)
    capacity = math.ceil(factor * len(prompt_ids) * TOP_K / EXPERTS)
    assert load["tokens"][0] == counts  # routed, before the cap
    assert load["dropped"][0] == [max(0, n - capacity) for n in counts]
    assert sum(load["dropped"][0]) > 0
    for row_tokens, row_dropped in zip(load["tokens"], load["dropped"], strict=True):
        assert all(n - d <= capacity for n, d in zip(row_tokens, row_dropped, strict=True))


def test_generous_capacity_changes_nothing(mixtral_dir):
    """A cap no expert reaches: outputs equal the uncapped engine's, nothing skipped."""
    capped = make_llm(mixtral_dir, moe_capacity_factor=float(EXPERTS))  # C = E: room for every token
    plain = make_llm(mixtral_dir)
    prompts = PROMPTS[:4]
    assert [o.outputs[0].token_ids for o in capped.generate(prompts, GREEDY)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    load = capped.engine.core.get_stats().expert_load
    assert sum(map(sum, load["dropped"])) == 0
    assert sum(map(sum, load["tokens"])) > len(prompts) * MAX_TOKENS * TOP_K


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_bad_capacity_factor_is_refused(mixtral_dir, bad):
    with pytest.raises(ValueError, match="moe_capacity_factor must be > 0"):
        make_llm(mixtral_dir, moe_capacity_factor=bad)


def test_capacity_factor_on_a_dense_model_is_refused(llama_dir):
    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_llm(llama_dir, moe_capacity_factor=1.25)


def test_periodic_log_line_names_the_imbalance(mixtral_dir, monkeypatch, caplog):
    monkeypatch.setattr(engine_core, "EXPERT_LOAD_LOG_INTERVAL_S", 0.0)
    llm = make_llm(mixtral_dir)
    with caplog.at_level(logging.INFO, logger=engine_core.__name__):
        llm.generate([PROMPTS[0]], GREEDY)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("expert load:")]
    assert lines and "imbalance (max/mean)" in lines[-1]


def test_summary_figures():
    stats = ExpertLoadStats([1, 3], 4)
    stats.add([[4, 0, 0, 0], [1, 1, 1, 1]], [[2, 0, 0, 0], [0, 0, 0, 0]])
    before = stats.as_dict()
    stats.add([[0, 0, 0, 4], [2, 2, 2, 2]], [[0, 0, 0, 0], [0, 0, 0, 0]])
    assert imbalance([4, 0, 0, 0]) == 4.0 and imbalance([1, 1, 1, 1]) == 1.0 and imbalance([0, 0]) is None
    whole = summarize(stats.as_dict())
    assert whole["imbalance_per_layer"] == [2.0, 1.0] and whole["worst_layer"] == 1
    assert whole["assignments"] == 20 and whole["dropped"] == 2
    since = summarize(stats.as_dict(), before)  # only the second step: layer 1's expert 3 took all
    assert since["max_imbalance"] == 4.0 and since["worst_layer"] == 1 and since["hottest_expert"] == 3
    assert since["dropped"] == 0
