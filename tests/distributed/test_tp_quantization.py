"""Weight quantization on multi-rank replicas: each tensor-parallel rank loads its shard of a quantized
checkpoint (or quantizes its float shard after loading), each pipeline stage its own layers.

The oracle is the same scheme at world size 1: greedy tokens equal and the chosen tokens' logprobs
within 1e-4. A shard is quantized per output row or per group, so a rank's codes and scales are the
whole layer's, column for column: a row-parallel rank's per-channel scale (int8, fp8, W8A8) is the
whole row's max, a checkpoint's per-tensor scale is the checkpoint's on every rank, and W8A8 rounds a
token by its whole row's max. Only the order of float32 sums differs. Each rank holds about 1/tp of
the quantized bytes. A layout the format cannot shard is one ValueError before any process starts.

Checkpoints are written by tests/models/test_quantized_checkpoints.py's encoders (GPTQ, AWQ,
compressed-tensors, FP8) and tests/gguf_writer.py (GGUF) from a tiny seeded Llama: hidden 128, 4
heads of 32, MLP 256, so a row-parallel rank reads 64 (o_proj) or 128 (down_proj) input columns.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))

from test_quantized_checkpoints import MODEL, VARIANTS, write_checkpoints  # noqa: E402

from kvtide import LLM, SamplingParams  # noqa: E402
from kvtide.engine_args import EngineArgs  # noqa: E402

PROMPTS = ["Hello", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
LOGPROB_TOL = 1e-4
TP2 = dict(tensor_parallel_size=2)
PP2 = dict(pipeline_parallel_size=2)


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", kv_cache_memory="4MiB", max_model_len=256, **kwargs)


def run(model_dir: str, **kwargs) -> tuple[list, list[int]]:
    """(greedy outputs of PROMPTS, weight bytes per rank) of one engine, shut down after."""
    parallel = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1) > 1
    llm = make_llm(model_dir, cpu_threads_per_rank=1, **kwargs) if parallel else make_llm(model_dir, **kwargs)
    try:
        executor = llm.engine.core.executor
        per_rank = list(executor.weight_bytes_per_rank) if parallel else [executor.runner.weight_bytes]
        return llm.generate(PROMPTS, GREEDY), per_rank
    finally:
        llm.shutdown()


def assert_same_decoding(whole: list, parallel: list, what: str) -> None:
    for i, (a, b) in enumerate(zip(whole, parallel, strict=True)):
        tokens = a.outputs[0].token_ids
        assert b.outputs[0].token_ids == tokens, f"{what} prompt {i}"
        for step, (la, lb, token) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs, tokens,
                                                   strict=True)):
            diff = abs(la[token].logprob - lb[token].logprob)
            assert diff <= LOGPROB_TOL, f"{what} prompt {i} step {step}: logprobs differ by {diff:.2e}"


def assert_split_in_two(whole_bytes: int, per_rank: list[int]) -> None:
    """Each of 2 TP ranks holds half the bytes, plus what every rank keeps whole (the RMSNorm
    weights: 5 x 128 float32) and a padding row of the odd vocabulary's table and LM head."""
    assert len(per_rank) == 2
    for rank_bytes in per_rank:
        assert whole_bytes / 2 <= rank_bytes <= whole_bytes / 2 + 0.012 * whole_bytes, (whole_bytes, per_rank)


@pytest.fixture(scope="module")
def base_dir(checkpoint_factory) -> str:
    return checkpoint_factory("LlamaForCausalLM", **MODEL)


@pytest.fixture(scope="module")
def world_one():
    """(model dir, quantization) -> run() at world size 1, once per module."""
    return functools.cache(lambda model_dir, quantization=None: run(model_dir, quantization=quantization))


@pytest.fixture(scope="module")
def checkpoint(base_dir, tmp_path_factory):
    """variant of test_quantized_checkpoints.VARIANTS -> its quantized checkpoint directory."""

    @functools.cache
    def get(variant: str) -> str:
        config, encoder, _, _ = VARIANTS[variant]
        return write_checkpoints(base_dir, str(tmp_path_factory.mktemp(variant)), config, encoder())[0]

    return get


# ---- quantized at load ------------------------------------------------------------------------------------
ONLINE = {"int8-tp2": ("int8", TP2), "int4-g32-tp2": ("int4", TP2), "fp8-tp2": ("fp8", TP2),
          "w8a8-tp2": ("w8a8", TP2)}


@pytest.mark.parametrize("case", list(ONLINE))
def test_online_quantization_tp2_decodes_like_world_size_1(base_dir, world_one, case):
    quantization, parallel = ONLINE[case]
    kwargs = dict(quantization_group_size=32) if quantization == "int4" else {}
    if kwargs:
        whole, whole_bytes = run(base_dir, quantization=quantization, **kwargs)
    else:
        whole, whole_bytes = world_one(base_dir, quantization)
    got, per_rank = run(base_dir, quantization=quantization, **parallel, **kwargs)
    assert_same_decoding(whole, got, case)
    assert_split_in_two(whole_bytes[0], per_rank)
    float_bytes = world_one(base_dir)[1][0]
    assert per_rank[0] < 0.3 * float_bytes  # quantized shards, not float ones (8-bit: ~0.25 of the float32 model)


def test_int8_pipeline_stages_quantize_their_own_layers(base_dir, world_one):
    whole, whole_bytes = world_one(base_dir, "int8")
    got, per_rank = run(base_dir, quantization="int8", **PP2)
    assert_same_decoding(whole, got, "int8-pp2")
    # untied: the first stage's layers and table, the last stage's layers, norm and LM head; nothing twice
    assert len(per_rank) == 2 and sum(per_rank) == whole_bytes[0]
    assert all(0.35 * whole_bytes[0] < b < 0.65 * whole_bytes[0] for b in per_rank)


def test_mixtral_experts_quantized_per_rank_under_expert_parallelism(checkpoint_factory):
    mixtral = checkpoint_factory("MixtralForCausalLM")
    whole, whole_bytes = run(mixtral, quantization="int8")
    got, per_rank = run(mixtral, quantization="int8", enable_expert_parallel=True, **TP2)
    assert_same_decoding(whole, got, "mixtral int8 tp2 ep")
    assert_split_in_two(whole_bytes[0], per_rank)


# ---- quantized checkpoints ---------------------------------------------------------------------------------
CHECKPOINTS = ["gptq-4bit-sym", "gptq-8bit-channel", "awq", "ct-w4a16-group", "ct-w8a8-int", "fp8-per-tensor"]


@pytest.mark.parametrize("variant", CHECKPOINTS)
def test_checkpoint_tp2_loads_its_shard_and_decodes_like_world_size_1(checkpoint, world_one, variant):
    model_dir = checkpoint(variant)
    whole, whole_bytes = world_one(model_dir)
    got, per_rank = run(model_dir, **TP2)
    assert_same_decoding(whole, got, variant)
    assert_split_in_two(whole_bytes[0], per_rank)


def test_gguf_tp2_splits_its_blocks_and_the_quantized_table(tmp_path_factory, monkeypatch):
    from gguf_writer import build_bpe_checkpoint, write_gguf

    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path_factory.mktemp("kvtide-cache")))
    hf_dir = build_bpe_checkpoint(str(tmp_path_factory.mktemp("bpe")), "LlamaForCausalLM", intermediate_size=384)
    path = write_gguf(hf_dir, str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"),
                      {"default": "Q4_0", "ffn": "Q4_1", "token_embd": "Q8_0"})
    whole, whole_bytes = run(path)
    got, per_rank = run(path, **TP2)
    assert_same_decoding(whole, got, "gguf q4_0/q4_1/q8_0 tp2")
    assert_split_in_two(whole_bytes[0], per_rank)


# ---- layouts a format cannot shard: one ValueError before any process starts ----------------------------------
def config_error(model_dir: str, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        EngineArgs(model=model_dir, cpu_threads_per_rank=1, **kwargs).create_engine_config(model_dir)
    return str(info.value)


def test_group_sizes_that_do_not_divide_a_rank_shard_are_refused(checkpoint_factory, checkpoint, tmp_path):
    # MLP 320: int4 groups of 64 fit the whole rows (320 = 5 x 64), not a rank's 160 columns
    wide = checkpoint_factory("LlamaForCausalLM", **dict(MODEL, intermediate_size=320))
    make_llm(wide, quantization="int4", quantization_group_size=64).shutdown()  # fine at world size 1
    message = config_error(wide, quantization="int4", quantization_group_size=64, **TP2)
    assert "int4 group size 64" in message and "intermediate_size: 320 / tensor_parallel_size=2 = 160" in message
    assert "32" in message.split("pick one of")[1]
    # o_proj's 128 input columns split in 4: 32 each, which groups of 64 do not divide
    message = config_error(checkpoint("gptq-4bit-asym"), tensor_parallel_size=4)
    assert "GPTQ group_size 64" in message and "tensor_parallel_size=4 = 32" in message


def test_formats_that_cannot_shard_are_refused_by_name(base_dir, checkpoint, tmp_path):
    assert "act-order (desc_act)" in config_error(checkpoint("gptq-desc-act"), **TP2)
    assert "act-order" in config_error(checkpoint("ct-naive-w4a16-act-order"), **TP2)
    # FP8 blocks of 96 columns: a row-parallel rank's 128 (down_proj) would start inside one
    assert "weight_block_size's columns 96" in config_error(checkpoint("fp8-block"), **TP2)
    text = tmp_path / "calibration.txt"
    text.write_text("some calibration text " * 20)
    assert "--calibration-data" in config_error(base_dir, quantization="w8a8", calibration_data=str(text), **PP2)
