"""Expert load on /metrics: a real `kvtide serve` of a tiny Qwen2-MoE checkpoint (started for this
module, always stopped), whose per-(layer, expert) counters after a prompt's prefill equal the
experts Hugging Face's own routers pick for that prompt's tokens, with the imbalance gauges computed
from them."""

from __future__ import annotations

import os

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import MODEL_NAME, launch_server, wait_idle

from kvtide.engine.messages import SchedulerStats
from kvtide.server.metrics import MAX_EXPERT_SERIES, ServerMetrics

QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                 norm_topk_prob=False, mlp_only_layers=[1])
PROMPT = "the scheduler gives each request a budget of tokens"


def samples(text: str, family_name: str) -> dict[tuple, float]:
    """{(label values but model_name, ...): value} of one family's counter/gauge samples."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name != family_name:
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[tuple(v for k, v in sorted(s.labels.items()) if k != "model_name")] = s.value
    return out


def hf_routing(model_dir: str, prompt_ids: list[int]) -> dict[int, list[int]]:
    """Per sparse layer: how many of the prompt's token assignments HF's router sends to each expert."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    counts: dict[int, list[int]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer.mlp, "gate"):
            continue
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda m, a, out, i=i: counts.__setitem__(i, torch.bincount(out[2].flatten(), minlength=4).tolist())))
    with torch.inference_mode():
        model(torch.tensor([prompt_ids]))
    for h in hooks:
        h.remove()
    return counts


@pytest.fixture(scope="module")
def moe_server(checkpoint_factory):
    model = checkpoint_factory("Qwen2MoeForCausalLM", **QWEN2_MOE)
    handle = launch_server(model, "--max-num-seqs", "4", api_key=None)
    try:
        yield handle, model
    finally:
        handle.stop()
        os.unlink(handle.log_path)


def test_expert_load_on_metrics_equals_hf_routing(moe_server):
    handle, model_dir = moe_server
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT).input_ids
    with handle.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        wait_idle(handle)
        text = c.get("/metrics").text
    reference = hf_routing(model_dir, prompt_ids)
    assert sorted(reference) == [0, 2, 3]  # layer 1 is dense (mlp_only_layers)
    tokens = samples(text, "kvtide:moe_expert_tokens")
    assert tokens == {(str(expert), str(layer)): float(n) for layer, row in reference.items()
                      for expert, n in enumerate(row)}
    per_layer = samples(text, "kvtide:moe_layer_tokens")
    assert per_layer == {(str(layer),): float(len(prompt_ids) * 2) for layer in reference}
    assert samples(text, "kvtide:moe_dropped_tokens") == {(str(layer),): 0.0 for layer in reference}
    imbalance = samples(text, "kvtide:moe_expert_load_imbalance")
    for layer, row in reference.items():
        assert imbalance[(str(layer),)] == pytest.approx(max(row) / (sum(row) / len(row)))
    assert samples(text, "kvtide:moe_expert_load_imbalance_max")[()] == pytest.approx(max(imbalance.values()))


def test_expert_series_stay_bounded_for_many_experts():
    """Past MAX_EXPERT_SERIES layer x expert pairs only the per-layer series are kept."""
    layers, experts = 64, MAX_EXPERT_SERIES // 64 + 1
    metrics = ServerMetrics("m")
    load = {"layers": list(range(layers)), "tokens": [[1] * experts for _ in range(layers)],
            "dropped": [[0] * experts for _ in range(layers)]}
    metrics.update_from_engine(SchedulerStats(expert_load=load))
    text = metrics.render().decode()
    assert samples(text, "kvtide:moe_expert_tokens") == {}
    assert len(samples(text, "kvtide:moe_layer_tokens")) == layers
    assert samples(text, "kvtide:moe_expert_load_imbalance_max")[()] == 1.0
