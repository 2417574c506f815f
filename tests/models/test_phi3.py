"""Phi-3 (Phi3ForCausalLM) against Hugging Face transformers in float32: greedy tokens equal to
`generate` and chosen-token logprobs within 1e-4, with the checkpoint's fused qkv_proj/gate_up_proj,
a sliding window, LongRoPE with partial rotary and tied embeddings, across batch sizes, chunked
prefill, preemption and a warm prefix cache; its GGUF files (llama.cpp's fused attn_qkv/ffn_up and
LongRoPE factor tensors) in F32 and Q8_0."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from hf_reference import hf_greedy, random_prompts

from kvtide import LLM, SamplingParams

MAX_TOKENS = 12
LOGPROB_TOL = 1e-4
ORIGINAL_WINDOW = 24
"""original_max_position_embeddings of the LongRoPE checkpoint: tiny, so prompts and generations cross it."""

LONGROPE = dict(
    partial_rotary_factor=0.5,  # head_dim 32: 16 rotated dimensions, 8 frequencies
    rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(8)],
                  "long_factor": [1.5 + 0.9 * i for i in range(8)]},
    original_max_position_embeddings=ORIGINAL_WINDOW, max_position_embeddings=8 * ORIGINAL_WINDOW,
    tie_word_embeddings=True)
CASES = {"plain": {}, "sliding-window": dict(sliding_window=16), "longrope-partial-tied": LONGROPE}

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog, then again and again."] + \
    random_prompts(3, seed=7, min_words=2, max_words=12)
"""5 prompts of 6 to ~90 tokens: past the sliding window and LongRoPE's original window."""
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def phi3_dir(checkpoint_factory, case: str) -> str:
    return checkpoint_factory("Phi3ForCausalLM", seed=3, **CASES[case])


def make_llm(model_dir: str, max_model_len: int = 160, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "8MiB")
    kwargs.setdefault("enable_prefix_caching", False)
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=max_model_len, **kwargs)


def assert_matches(reference, prompt: str, out, where: str) -> None:
    """`reference`: an HFGreedy; tokens equal, each chosen token's logprob within LOGPROB_TOL."""
    got = out.outputs[0].token_ids
    assert out.prompt_token_ids == reference.prompt_ids, f"{where}: tokenization differs"
    assert got == reference.token_ids, f"{where} {prompt!r}: kvtide {got} != HF {reference.token_ids}"
    for step, (token, logprobs) in enumerate(zip(got, out.outputs[0].logprobs, strict=True)):
        diff = abs(logprobs[token].logprob - reference.logprobs[step, token].item())
        assert diff < LOGPROB_TOL, f"{where} {prompt!r} step {step}: logprob off by {diff:.2e}"


def assert_matches_hf(model_dir: str, prompts: list[str], outputs) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        assert_matches(hf_greedy(model_dir, prompt, MAX_TOKENS), prompt, out, f"prompt {i}")


# ---- engine paths --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_batch_of_one_and_of_five_match_hf(checkpoint_factory, case):
    """The longrope checkpoint here serves past its original window (max_model_len 160 > 24), so its
    long factors serve every position: transformers' choice for the prompts longer than the window."""
    model_dir = phi3_dir(checkpoint_factory, case)
    llm = make_llm(model_dir)
    prompts = PROMPTS if case != "longrope-partial-tied" else \
        [p for p in PROMPTS if len(llm.get_tokenizer().encode(p)) > ORIGINAL_WINDOW]
    assert len(prompts) >= 3
    assert_matches_hf(model_dir, prompts[:1], llm.generate(prompts[:1], GREEDY))
    assert_matches_hf(model_dir, prompts, llm.generate(prompts, GREEDY))


@pytest.mark.parametrize("case", ["plain", "longrope-partial-tied"])
def test_chunked_prefill_preemption_and_warm_prefix_cache_match_hf(checkpoint_factory, case):
    model_dir = phi3_dir(checkpoint_factory, case)
    prompts = [p for p in PROMPTS if len(p) > ORIGINAL_WINDOW]
    chunked = make_llm(model_dir, max_num_batched_tokens=8, enable_prefix_caching=True)
    assert_matches_hf(model_dir, prompts, chunked.generate(prompts, GREEDY))
    warm = chunked.generate(prompts, GREEDY)  # the same prompts again: their blocks are cached
    chunked.engine.core.scheduler.kv_cache_manager.pool.check_integrity()
    assert_matches_hf(model_dir, prompts, warm)

    probe = make_llm(model_dir, kv_cache_memory="1MiB")
    block_bytes = probe.engine.core.executor.kv_bytes_per_block()
    max_model_len = 112  # past the original window: the long factors still
    assert max(len(probe.get_tokenizer().encode(p)) for p in prompts) + MAX_TOKENS <= max_model_len
    num_blocks = max_model_len // 16 + 1  # room for the longest request and little else
    tight = make_llm(model_dir, max_model_len=max_model_len, kv_cache_memory=str(num_blocks * block_bytes))
    crowd = prompts + random_prompts(4, seed=11, min_words=10, max_words=14)
    assert_matches_hf(model_dir, crowd, tight.generate(crowd, GREEDY))
    assert tight.engine.core.scheduler.num_preemptions > 0


# ---- LongRoPE's short and long factors around the original window --------------------------------
def test_longrope_within_the_original_window_matches_hf(checkpoint_factory):
    """max_model_len <= original_max_position_embeddings: transformers never leaves the short
    factors, nor does kvtide's table."""
    model_dir = phi3_dir(checkpoint_factory, "longrope-partial-tied")
    prompts = ["Hi", "hello", "a b c"]  # prompt + 12 generated tokens stay within 24
    llm = make_llm(model_dir, max_model_len=ORIGINAL_WINDOW)
    assert_matches_hf(model_dir, prompts, llm.generate(prompts, GREEDY))


@functools.cache
def _hf_long_factors_model(model_dir: str):
    """transformers' Phi-3 with its long factors from the first position: its short inv_freq
    replaced by the long one (which it switches to past the original window)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    rotary = model.model.rotary_emb
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, None, seq_len=ORIGINAL_WINDOW + 1)
    assert not torch.equal(long_inv_freq, rotary.original_inv_freq)
    rotary.original_inv_freq.copy_(long_inv_freq)
    rotary.inv_freq.copy_(long_inv_freq)
    return model


def test_generation_crossing_the_original_window(checkpoint_factory):
    """A prompt within the window whose generation grows past it, on an engine serving longer
    sequences: kvtide rotates every position with the long factors (one table for the engine's
    life, see layers/rotary.py), which is transformers' computation once it has switched (its
    Phi-3 `generate` then recomputes the whole cache with them): equal to transformers run on the
    long factors throughout, token for token, across the crossing."""
    model_dir = phi3_dir(checkpoint_factory, "longrope-partial-tied")
    llm = make_llm(model_dir)
    max_tokens = 30
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    prompts = ["Hi there", "The quick brown"]  # 9 and 16 tokens: crossing 24 while generating
    model = _hf_long_factors_model(model_dir)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        assert ids.shape[1] < ORIGINAL_WINDOW < ids.shape[1] + max_tokens
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=2)
        tokens = ref.sequences[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == tokens, prompt
        logprobs = torch.cat(ref.logits).float().log_softmax(-1)
        for step, (token, lp) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
            assert abs(lp[token].logprob - logprobs[step, token].item()) < LOGPROB_TOL, (prompt, step)


# ---- what the fast paths may do with it ----------------------------------------------------------
def test_fused_decode_and_cuda_graph_declarations(checkpoint_factory):
    from kvtide.layers.fused_decode import FusedDecodePlan
    from kvtide.layers.rotary import PartialRotaryEmbedding

    plain = make_llm(phi3_dir(checkpoint_factory, "plain")).engine.core.executor
    partial = make_llm(phi3_dir(checkpoint_factory, "longrope-partial-tied")).engine.core.executor
    plain_model, partial_model = (_model(executor) for executor in (plain, partial))
    if plain_model.fused_decode is not None:  # on where the compiled layer op builds: it ran the parity tests
        assert len(plain_model.fused_decode.layer_weights) == len(plain_model.layers)
    assert partial_model.fused_decode is None
    assert all(isinstance(layer.fused_decode_plan(), FusedDecodePlan) for layer in plain_model.layers)
    assert isinstance(partial_model.rotary_emb, PartialRotaryEmbedding)
    assert partial_model.layers[0].fused_decode_plan() == "rotary over part of each head (partial_rotary_factor)"
    # one rotary table indexed by position, no per-step host values: decode steps may be captured
    assert plain_model.cuda_graph_unsupported() is None and partial_model.cuda_graph_unsupported() is None
    assert partial_model.lm_head.tied_to is partial_model.embed_tokens  # tie_word_embeddings


def _model(executor):
    return executor.runner.model


def test_fused_shards_split_lazily_by_rows():
    from kvtide.models.lazy_tensor import LazyRows, LazyTensor, row_range

    full = torch.arange(60.0).reshape(10, 6)

    class Slice:  # safetensors' slice: shape and indexing
        def get_shape(self):
            return list(full.shape)

        def __getitem__(self, index):
            return full[index]

    rows = row_range(LazyTensor(Slice()), 4, 5)
    assert isinstance(rows, LazyRows) and rows.shape == (5, 6)
    assert torch.equal(rows.materialize(), full[4:9])
    assert torch.equal(rows.narrow(0, 1, 2), full[5:7])
    assert torch.equal(row_range(rows, 1, 3).narrow(1, 2, 3), full[5:8, 2:5])


# ---- GGUF ----------------------------------------------------------------------------------------
GGUF_CONFIG = dict(intermediate_size=384)
"""Row lengths divisible by Q8_0's block of 32."""


@pytest.fixture()
def _own_gguf_cache(tmp_path_factory, monkeypatch, compiled_cpu_ops):
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path_factory.getbasetemp() / "kvtide-cache"))


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
def test_gguf_matches_transformers_loading_the_same_file(tmp_path_factory, _own_gguf_cache, tensor_type):
    from gguf_writer import build_bpe_checkpoint, write_gguf
    from safetensors.torch import load_file

    from kvtide.models.gguf_checkpoint import iterate_gguf_weights

    ckpt = build_bpe_checkpoint(str(tmp_path_factory.mktemp("phi3-bpe")), "Phi3ForCausalLM", **GGUF_CONFIG)
    path = write_gguf(ckpt, str(tmp_path_factory.mktemp("phi3-gguf") / "phi3.gguf"), tensor_type)
    if tensor_type == "F32":  # the fused tensors split back into exactly the checkpoint's rows
        loaded = dict(iterate_gguf_weights(path))
        reference = load_file(os.path.join(ckpt, "model.safetensors"))
        assert torch.equal(torch.cat([loaded[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]),
                           reference["model.layers.1.self_attn.qkv_proj.weight"])
        assert torch.equal(torch.cat([loaded["model.layers.1.mlp.gate_proj.weight"],
                                      loaded["model.layers.1.mlp.up_proj.weight"]]),
                           reference["model.layers.1.mlp.gate_up_proj.weight"])
    llm = make_llm(path)
    if tensor_type == "Q8_0":  # kept quantized, as the file holds them
        qkv = _model(llm.engine.core.executor).layers[0].self_attn.qkv_proj
        assert qkv.quantized is not None and qkv.quantized.kind == "int8"
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    _assert_gguf_greedy(llm, hf)


def test_gguf_longrope_partial_rotary_matches_its_checkpoint(tmp_path_factory, _own_gguf_cache):
    """transformers' GGUF loading reads neither the rotated part of the head nor the LongRoPE
    factors, so the reference is the original checkpoint with the file's (Q8_0) weights."""
    from gguf_writer import build_bpe_checkpoint, write_gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvtide.models.gguf_checkpoint import iterate_gguf_weights, prepare_gguf_model_dir

    ckpt = build_bpe_checkpoint(str(tmp_path_factory.mktemp("phi3-bpe")), "Phi3ForCausalLM",
                                **dict(GGUF_CONFIG, **LONGROPE))
    path = write_gguf(ckpt, str(tmp_path_factory.mktemp("phi3-gguf") / "phi3-longrope.gguf"), "Q8_0")
    ours, theirs = AutoConfig.from_pretrained(prepare_gguf_model_dir(path)), AutoConfig.from_pretrained(ckpt)
    # the file holds the factors in float32, the precision transformers computes them in
    for key in ("short_factor", "long_factor"):
        assert torch.equal(torch.tensor(ours.rope_parameters.pop(key), dtype=torch.float32),
                           torch.tensor(theirs.rope_parameters.pop(key), dtype=torch.float32))
    assert ours.rope_parameters == theirs.rope_parameters
    assert ours.original_max_position_embeddings == ORIGINAL_WINDOW and ours.tie_word_embeddings
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    weights = {}
    for name, tensor in iterate_gguf_weights(path):  # fused back as the checkpoint holds them
        weights[name] = tensor
    for i in range(theirs.num_hidden_layers):
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.self_attn.qkv_proj.weight"] = torch.cat(
            [weights.pop(f"{prefix}.self_attn.{p}_proj.weight") for p in "qkv"])
        weights[f"{prefix}.mlp.gate_up_proj.weight"] = torch.cat(
            [weights.pop(f"{prefix}.mlp.{p}_proj.weight") for p in ("gate", "up")])
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    # within the original window (the long factors' table is the one the other tests check)
    _assert_gguf_greedy(make_llm(path, max_model_len=ORIGINAL_WINDOW), reference, ["Hi", "def f(a):"], 8)


def _assert_gguf_greedy(llm: LLM, hf, prompts=("The quick brown fox jumps over", "def add(a, b):"),
                        max_tokens: int = MAX_TOKENS) -> None:
    hf.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for out in llm.generate(list(prompts), params):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=2)
        tokens = ref.sequences[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == tokens
        logprobs = torch.cat(ref.logits).float().log_softmax(-1)
        for step, (token, lp) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
            assert abs(lp[token].logprob - logprobs[step, token].item()) < LOGPROB_TOL, step
