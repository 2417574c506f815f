"""--generation-config: with `auto` a request's unset temperature, top_p, top_k, min_p and
repetition_penalty come from the checkpoint's generation_config.json; `vllm` keeps kvtide's
neutral defaults; a path reads that file. The CLIs leave unset what their flags do not set."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
from torch_threads import one_torch_thread

from kvtide import LLM, SamplingParams
from kvtide.cli import build_parser, sampling_params_from_args
from kvtide.engine.generation_defaults import load_generation_defaults
from kvtide.sampling_params import GENERATION_DEFAULT_FIELDS

PROMPT = "Once upon a time"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    yield from one_torch_thread()


def with_generation_config(source: str, target: str, **values) -> str:
    """A copy of checkpoint `source` whose generation_config.json also sets `values`."""
    shutil.copytree(source, target)
    path = os.path.join(target, "generation_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(values)
    with open(path, "w") as f:
        json.dump(config, f)
    return target


@pytest.fixture(scope="module")
def greedy_by_default(llama_dir, tmp_path_factory) -> str:
    """The tiny Llama whose generation_config.json makes sampling greedy: top_k 1 (at temperature 0.7)."""
    return with_generation_config(llama_dir, str(tmp_path_factory.mktemp("gen") / "model"), temperature=0.7, top_k=1,
                                  do_sample=True)


def unset(**kwargs) -> SamplingParams:
    """Four samples, seeded, with no sampling field set."""
    return SamplingParams(n=4, seed=7, max_tokens=12, ignore_eos=True, **kwargs)


def test_auto_takes_the_models_defaults_and_vllm_does_not(greedy_by_default, caplog):
    with caplog.at_level(logging.INFO, logger="kvtide.engine.input_processor"):
        auto = LLM(model=greedy_by_default, kv_cache_memory="16MiB", max_model_len=128)
    assert "temperature=0.7, top_k=1" in caplog.text  # the startup log names the defaults in force
    greedy = auto.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    samples = [c.token_ids for c in auto.generate(PROMPT, unset())[0].outputs]
    assert samples == [greedy] * 4
    assert (auto.get_default_sampling_params().temperature, auto.get_default_sampling_params().top_k) == (0.7, 1)
    # A field the request sets wins over the model's.
    free = [c.token_ids for c in auto.generate(PROMPT, unset(top_k=-1))[0].outputs]
    assert len({tuple(t) for t in free}) > 1
    auto.shutdown()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvtide.engine.input_processor"):
        neutral = LLM(model=greedy_by_default, kv_cache_memory="16MiB", max_model_len=128, generation_config="vllm")
    assert "neutral" in caplog.text
    samples = [c.token_ids for c in neutral.generate(PROMPT, unset())[0].outputs]
    assert len({tuple(t) for t in samples}) > 1 and greedy not in samples
    assert neutral.generate(PROMPT, unset(top_k=1))[0].outputs[0].token_ids == greedy
    neutral.shutdown()


def test_defaults_file_by_path_and_bad_values(greedy_by_default, tmp_path, llama_dir):
    path = os.path.join(greedy_by_default, "generation_config.json")
    assert load_generation_defaults("auto", greedy_by_default) == {"temperature": 0.7, "top_k": 1}
    assert load_generation_defaults(path, llama_dir) == {"temperature": 0.7, "top_k": 1}
    assert load_generation_defaults(greedy_by_default, llama_dir) == {"temperature": 0.7, "top_k": 1}
    assert load_generation_defaults("vllm", greedy_by_default) == {}
    assert load_generation_defaults("auto", llama_dir) == {}  # it sets none of the five
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 0, "top_p": 0.9}))
    assert load_generation_defaults(str(tmp_path), llama_dir) == {"top_k": -1, "top_p": 0.9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature"):
        load_generation_defaults(str(tmp_path), llama_dir)
    with pytest.raises(ValueError, match="generation_config"):
        load_generation_defaults(str(tmp_path / "missing"), llama_dir)


def test_unset_fields_survive_clone_and_explicit_ones_win():
    params = SamplingParams(max_tokens=3, temperature=0.5)
    assert params.unset_fields == set(GENERATION_DEFAULT_FIELDS) - {"temperature"}
    assert params.clone(n=2).unset_fields == params.unset_fields
    filled = params.with_defaults({"temperature": 0.1, "top_p": 0.8})
    assert (filled.temperature, filled.top_p) == (0.5, 0.8)
    assert SamplingParams(use_beam_search=True, n=2).with_defaults({"repetition_penalty": 1.2}).repetition_penalty == 1.0


def test_cli_flags_leave_unset_what_they_do_not_set():
    args = build_parser("generate").parse_args(["generate", "--prompt", "x", "--max-tokens", "4"])
    assert sampling_params_from_args(args).unset_fields == set(GENERATION_DEFAULT_FIELDS)
    args = build_parser("generate").parse_args(["generate", "--prompt", "x", "--top-k", "3",
                                                "--repetition-penalty", "1.1", "--generation-config", "vllm"])
    params = sampling_params_from_args(args)
    assert params.unset_fields == {"temperature", "top_p", "min_p"} and params.top_k == 3
    assert args.generation_config == "vllm"
