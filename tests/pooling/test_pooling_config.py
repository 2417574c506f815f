"""How a pooling model's pooler is resolved (architecture, --convert, sentence-transformers files,
--pooler-config) and what the pure pooling helpers refuse; no model runs here."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvtide.pooling.config import PoolerConfig, resolve_pooling
from kvtide.pooling.params import PoolingParams
from kvtide.pooling.scoring import check_truncation, score_pairs, truncate_ids


def hf(arch: str, **fields) -> SimpleNamespace:
    return SimpleNamespace(architectures=[arch], hidden_size=64, **fields)


def test_auto_runner_follows_the_architecture(tmp_path):
    assert resolve_pooling("auto", "auto", None, hf("LlamaForCausalLM"), str(tmp_path)) is None
    embed = resolve_pooling("auto", "auto", None, hf("Qwen3Model"), str(tmp_path))
    assert (embed.task, embed.pooling_type, embed.normalize, embed.causal) == ("embed", "LAST", True, True)
    assert embed.prefix_caching_ok
    classify = resolve_pooling("auto", "auto", None, hf("Qwen2ForSequenceClassification", num_labels=2,
                                                        id2label={"0": "no", "1": "yes"}), str(tmp_path))
    assert (classify.task, classify.normalize, classify.num_labels, classify.id2label) == \
        ("classify", False, 2, {0: "no", 1: "yes"})
    bert = resolve_pooling("auto", "auto", None, hf("BertModel"), str(tmp_path))
    assert (bert.pooling_type, bert.causal, bert.prefix_caching_ok) == ("CLS", False, False)


def test_convert_rewrites_the_architecture(tmp_path):
    config = hf("LlamaForCausalLM")
    assert resolve_pooling("pooling", "auto", None, config, str(tmp_path)).task == "embed"
    assert config.architectures == ["LlamaModel"]
    config = hf("Qwen3ForCausalLM", num_labels=1)
    assert resolve_pooling("pooling", "classify", None, config, str(tmp_path)).task == "classify"
    assert config.architectures == ["Qwen3ForSequenceClassification"]
    with pytest.raises(ValueError, match="cannot run architecture GptOssForCausalLM"):
        resolve_pooling("pooling", "embed", None, hf("GptOssForCausalLM"), str(tmp_path))
    assert resolve_pooling("generate", "auto", None, hf("Qwen3Model"), str(tmp_path)) is None


def test_pooler_config_overrides_and_refusals(tmp_path):
    config = resolve_pooling("auto", "auto", '{"pooling_type": "mean", "normalize": false}', hf("Qwen3Model"),
                             str(tmp_path))
    assert (config.pooling_type, config.normalize, config.prefix_caching_ok) == ("MEAN", False, False)
    for bad, match in [("{not json", "not valid JSON"), ('{"pool": 1}', "unknown field"),
                       ('{"pooling_type": "MAX"}', "pooling_type"), ('{"dimensions": 0}', "dimensions"),
                       ('[1]', "JSON object")]:
        with pytest.raises(ValueError, match=match):
            resolve_pooling("auto", "auto", bad, hf("Qwen3Model"), str(tmp_path))
    with pytest.raises(ValueError, match="pooling models only"):
        resolve_pooling("generate", "auto", '{"normalize": true}', hf("Qwen3Model"), str(tmp_path))
    with pytest.raises(ValueError, match="runner"):
        resolve_pooling("embed", "auto", None, hf("Qwen3Model"), str(tmp_path))


def test_sentence_transformers_files_set_pooling_and_normalization(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    config = resolve_pooling("auto", "auto", None, hf("BertModel"), str(tmp_path))
    assert (config.pooling_type, config.normalize) == ("MEAN", False)  # no Normalize module
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="exactly one of"):
        resolve_pooling("auto", "auto", None, hf("BertModel"), str(tmp_path))


def test_matryoshka_dimensions_are_declared_or_refused(tmp_path):
    plain = resolve_pooling("auto", "auto", None, hf("Qwen3Model"), str(tmp_path))
    with pytest.raises(ValueError, match="Matryoshka"):
        plain.check_dimensions(32, 64)
    declared = resolve_pooling("auto", "auto", None, hf("Qwen3Model", matryoshka_dimensions=[16, 32]), str(tmp_path))
    declared.check_dimensions(32, 64)
    with pytest.raises(ValueError, match="not one this model supports"):
        declared.check_dimensions(20, 64)
    anywhere = resolve_pooling("auto", "auto", None, hf("Qwen3Model", is_matryoshka=True), str(tmp_path))
    anywhere.check_dimensions(20, 64)
    with pytest.raises(ValueError, match="not one this model supports"):
        anywhere.check_dimensions(65, 64)
    assert PoolerConfig.from_fields({**declared.__dict__, "matryoshka_dimensions": [16, 32], "hidden_size": 64}) \
        == declared


def test_params_and_scoring_helpers_refuse_bad_values():
    with pytest.raises(ValueError, match="task"):
        PoolingParams(task="generate")
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    assert PoolingParams.from_wire(PoolingParams(task="score").to_wire()) == PoolingParams(task="score")
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    with pytest.raises(ValueError, match="one-to-one or one-to-many"):
        score_pairs(["q", "r"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="empty"):
        score_pairs([], "a")
    assert check_truncation(-1, 100) == 100 and check_truncation(None, 100) is None
    with pytest.raises(ValueError, match="at most the longest prompt"):
        check_truncation(101, 100)
    assert truncate_ids([1, 2, 3, 4], 2) == [3, 4]


def test_pooling_fields_cross_every_process_boundary():
    """Engine-core requests (API -> core), scheduler outputs (core -> worker ranks) and runner outputs
    (ranks -> core) keep their pooling fields through msgpack."""
    from kvtide.engine.request import EngineCoreRequest
    from kvtide.engine.serialization import decode, encode, request_from_wire, request_to_wire
    from kvtide.sampling_params import SamplingParams
    from kvtide.scheduler.output import ModelRunnerOutput, NewRequestData, SchedulerOutput
    from kvtide.worker.wire import (
        runner_output_from_wire,
        runner_output_to_wire,
        scheduler_output_from_wire,
        scheduler_output_to_wire,
    )

    params = PoolingParams(task="embed", normalize=False, dimensions=16)
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=1), pooling_params=params)
    assert request_from_wire(decode(encode(["add", request_to_wire(request)]))[1]).pooling_params == params
    new = NewRequestData("r", [1, 2, 3], 3, SamplingParams(max_tokens=1), [0], 0, pooling_params=params)
    so = SchedulerOutput([new], [], {"r": 3}, 3)
    back = scheduler_output_from_wire(decode(encode(["step", scheduler_output_to_wire(so)]))[1])
    assert back.scheduled_new_reqs[0].pooling_params == params
    output = ModelRunnerOutput(sampled_token_ids={}, pooler_output={"r": [0.5, -0.25]})
    assert runner_output_from_wire(runner_output_to_wire(output)).pooler_output == {"r": [0.5, -0.25]}
