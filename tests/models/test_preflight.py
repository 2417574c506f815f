"""The checks `kvtide serve` runs before its engine core starts (models/preflight.py) refuse what the
engine refuses, with the engine's message, and pass what the engine loads."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from checkpoint_edits import set_architecture

from kvtide.engine_args import EngineArgs
from kvtide.models.loader import iterate_weights
from kvtide.models.preflight import check_checkpoint_dir
from kvtide.tokenizer import load_tokenizer


@pytest.fixture
def copy(llama_dir, tmp_path):
    target = str(tmp_path / "model")
    shutil.copytree(llama_dir, target)
    return target


def _truncate(path: str, keep: float) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])


def _engine_error(action) -> str:
    with pytest.raises(ValueError) as info:
        action()
    return str(info.value)


def test_a_good_checkpoint_passes(llama_dir):
    check_checkpoint_dir(llama_dir)


@pytest.mark.parametrize("keep", [0.0, 0.001, 0.34, 0.999])
def test_a_truncated_weights_file_is_refused_as_the_loader_refuses_it(copy, keep):
    path = os.path.join(copy, "model.safetensors")
    _truncate(path, keep)
    loader_says = _engine_error(lambda: list(iterate_weights(copy)))
    preflight_says = _engine_error(lambda: check_checkpoint_dir(copy))
    prefix = f"cannot read weights from {path} ("
    assert loader_says.startswith(prefix) and preflight_says.startswith(prefix), (loader_says, preflight_says)
    assert preflight_says.split(")")[-1] == loader_says.split(")")[-1]  # the same advice


def test_a_sharded_checkpoint_is_checked_shard_by_shard(copy):
    os.rename(os.path.join(copy, "model.safetensors"), os.path.join(copy, "model-00001-of-00001.safetensors"))
    with open(os.path.join(copy, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}, f)
    check_checkpoint_dir(copy)
    _truncate(os.path.join(copy, "model-00001-of-00001.safetensors"), 0.5)
    assert "model-00001-of-00001.safetensors" in _engine_error(lambda: check_checkpoint_dir(copy))


def test_an_unknown_architecture_gets_the_engines_message(copy):
    set_architecture(copy, "FooBarForCausalLM")
    engine_says = _engine_error(lambda: EngineArgs(model=copy).create_engine_config(copy))
    assert _engine_error(lambda: check_checkpoint_dir(copy)) == engine_says


def test_no_tokenizer_files_is_refused_unless_another_tokenizer_is_given(copy, llama_dir):
    for name in os.listdir(copy):
        if name.startswith(("tokenizer", "special_tokens")):
            os.unlink(os.path.join(copy, name))
    with pytest.raises(ValueError):
        load_tokenizer(copy)  # the engine cannot load it either
    message = _engine_error(lambda: check_checkpoint_dir(copy))
    assert message.startswith(f"cannot load a tokenizer from {copy} (") and "--tokenizer DIR" in message
    check_checkpoint_dir(copy, tokenizer_dir=llama_dir)


def test_remote_code_is_left_to_the_engine(copy):
    set_architecture(copy, "FooBarForCausalLM")
    check_checkpoint_dir(copy, trust_remote_code=True)
