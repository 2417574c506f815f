"""Loading checkpoints: sharded safetensors, a bf16 checkpoint run in float32, and the errors a user
gets for an unsupported architecture or a damaged weights file."""

from __future__ import annotations

import copy
import glob
import json
import os
import shutil

import pytest
import torch
from checkpoint_edits import set_architecture
from hf_reference import CJK_EMOJI_PROMPT, LONG_PROMPT, hf_greedy, hf_model_and_tokenizer
from safetensors.torch import load_file, save_file

from kvtide import LLM, SamplingParams

MAX_TOKENS = 16
PROMPTS = ["Hello", CJK_EMOJI_PROMPT, LONG_PROMPT]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, device="cpu", kv_cache_memory="8MiB", max_model_len=512, **kwargs)


def assert_same_tokens_as_hf(llm: LLM, reference_dir: str) -> None:
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY), strict=True):
        ref = hf_greedy(reference_dir, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == ref.token_ids
        assert out.outputs[0].text == ref.text


def copy_checkpoint(src: str, dst: str, skip_weights: bool = False) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*") if skip_weights else None)
    return dst


def runner_model(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.executor.runner.model


def test_sharded_checkpoint_with_index(llama_dir, tmp_path):
    model, tokenizer = hf_model_and_tokenizer(llama_dir)
    path = str(tmp_path / "sharded")
    model.save_pretrained(path, max_shard_size="300KB")
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 2 and len(glob.glob(os.path.join(path, "*.safetensors"))) == len(shards)
    assert_same_tokens_as_hf(make_llm(path), llama_dir)


def test_bf16_checkpoint_runs_in_float32(checkpoint_factory, tmp_path):
    src = checkpoint_factory("Qwen2ForCausalLM", tie_word_embeddings=True)
    path = copy_checkpoint(src, str(tmp_path / "bf16"), skip_weights=True)
    model, _ = hf_model_and_tokenizer(src)
    # a copy: a round trip of the cached reference model through bf16 would round its weights, and
    # every later reference of this checkpoint in the session would be computed from those
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(os.path.join(path, "model.safetensors")).values())
    llm = make_llm(path)  # dtype auto: float32 on CPU
    assert {p.dtype for p in runner_model(llm).parameters()} == {torch.float32}
    # The reference: HF loads the same bf16 weights upcast to float32.
    assert_same_tokens_as_hf(llm, path)


def test_unknown_architecture_names_the_supported_ones(llama_dir, tmp_path):
    path = copy_checkpoint(llama_dir, str(tmp_path / "unknown"))
    set_architecture(path, "FancyNewForCausalLM")
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as info:
        make_llm(path)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(info.value)


@pytest.mark.parametrize("damage", ["truncated", "bad-header"])
def test_corrupt_safetensors_is_a_value_error(llama_dir, tmp_path, damage):
    path = copy_checkpoint(llama_dir, str(tmp_path / damage))
    weights = os.path.join(path, "model.safetensors")
    size = os.path.getsize(weights)
    if damage == "truncated":
        with open(weights, "r+b") as f:
            f.truncate(size // 2)
    else:
        with open(weights, "r+b") as f:
            f.write(b"\xff" * 16)
    with pytest.raises(ValueError, match="model.safetensors"):
        make_llm(path)


@pytest.mark.parametrize("checkpoint_name, parameter", [
    ("model.layers.1.self_attn.k_proj.weight", "layers.1.self_attn.qkv_proj.weight"),  # one of q, k, v
    ("model.layers.2.mlp.up_proj.weight", "layers.2.mlp.gate_up_proj.weight"),  # one of gate, up
    ("model.norm.weight", "norm.weight"),
])
def test_missing_tensor_is_a_value_error(llama_dir, tmp_path, checkpoint_name, parameter):
    """A parameter left unfilled would hold uninitialised memory: refuse the checkpoint, even when
    the other shards of a fused parameter are there."""
    path = copy_checkpoint(llama_dir, str(tmp_path / "missing"), skip_weights=True)
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    del tensors[checkpoint_name]
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=parameter.replace(".", r"\.")):
        make_llm(path)
