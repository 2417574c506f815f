"""gpt-oss (models/gpt_oss.py) against Hugging Face in float32: greedy tokens equal to `generate`,
chosen-token logprobs within 1e-4, through batching, chunked prefill, preemption, a warm prefix
cache, prompts longer than the sliding window, and each backend that applies sink logits.

The tiny checkpoint alternates sliding (16-token window) and full layers, rotates with YaRN (factor
8 over an original 128 positions, which the long prompt passes), routes each token to 2 of 8
experts, and has biases on every projection. transformers initializes the biases to 0 and the sinks
near 0 and the norms to 1, which would leave them barely tested, so the fixture rewrites them with
seeded noise (sinks of a few units, so some heads give the sink most of their weight). Guards check
that the sinks and the window change HF's own tokens, so matching HF tests them. An MXFP4 copy of
the checkpoint (its experts encoded from the format's description) is compared with HF run on the
float weights it decodes to.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hf_reference import (
    CJK_EMOJI_PROMPT,
    LONG_PROMPT,
    assert_greedy_and_logprobs_match_hf,
    hf_greedy,
    hf_prompt_ids,
)
from safetensors.torch import load_file, save_file

from kvtide import LLM, SamplingParams
from kvtide.kv_cache.hybrid import HybridKVCacheManager, blocks_held
from kvtide.models.gpt_oss import GptOssExperts

ARCH = "GptOssForCausalLM"
WINDOW = 16
MAX_TOKENS = 24
MAX_MODEL_LEN = 400
LOGPROB_TOL = 1e-4
INIT = 0.1
"""initializer_range: large enough for peaked, varied greedy tokens at hidden size 64."""
CONFIG = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
              sliding_window=WINDOW, max_position_embeddings=1024, initializer_range=INIT,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})
SINK_SCALE = 2.0
NO_SINK = -1e4
"""A sink logit whose exp(...) is 0 in float32: the sink takes no weight."""

PROMPTS = ["Hello", CJK_EMOJI_PROMPT, LONG_PROMPT, "The quick brown fox jumps over the lazy dog."]
"""6 to over 300 tokens: all but the first cross the window."""
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


def perturb_weights(model_dir: str, sinks: float | None, seed: int = 1) -> None:
    """Sinks to seeded noise times SINK_SCALE (or all to `sinks` when given), every bias to noise of
    the weights' scale, norm weights to 1 + noise."""
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        shape = tensors[name].shape
        if name.endswith(".sinks"):
            noise = torch.randn(shape, generator=generator) * SINK_SCALE
            tensors[name] = noise if sinks is None else torch.full(shape, sinks)
        elif name.endswith("bias"):
            tensors[name] = torch.randn(shape, generator=generator) * INIT
        elif name.endswith("norm.weight"):
            tensors[name] = 1 + torch.randn(shape, generator=generator) * 0.3
    assert sum(name.endswith(".sinks") for name in tensors) == CONFIG["num_hidden_layers"]
    save_file(tensors, path, metadata={"format": "pt"})


def gpt_oss_checkpoint(checkpoint_factory, tmp_path_factory, sinks: float | None = None, **overrides) -> str:
    built = checkpoint_factory(ARCH, seed=0, **dict(CONFIG, **overrides))
    model_dir = str(tmp_path_factory.mktemp("gptoss-perturbed"))
    shutil.copytree(built, model_dir, dirs_exist_ok=True)
    perturb_weights(model_dir, sinks)
    return model_dir


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory, tmp_path_factory) -> str:
    return gpt_oss_checkpoint(checkpoint_factory, tmp_path_factory)


def make_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "16MiB")
    kwargs.setdefault("enable_prefix_caching", False)
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, **kwargs)


def assert_matches_hf(model_dir: str, prompts: list[str], outputs, check_logprobs: bool = False) -> None:
    assert_greedy_and_logprobs_match_hf(model_dir, prompts, outputs, MAX_TOKENS,
                                        LOGPROB_TOL if check_logprobs else None)


# ---- the checkpoint tests what it should -----------------------------------------------------------
def test_prompts_cross_the_window_and_outputs_are_not_degenerate(model_dir):
    lengths = [len(hf_prompt_ids(model_dir, p)) for p in PROMPTS]
    assert sum(n > WINDOW for n in lengths) == 3 and max(lengths) > 300, lengths
    distinct = [len(set(hf_greedy(model_dir, p, MAX_TOKENS).token_ids)) for p in PROMPTS]
    assert all(n >= 4 for n in distinct), distinct


def test_the_sinks_change_hf_tokens(checkpoint_factory, tmp_path_factory, model_dir):
    """Guard: the same checkpoint with sinks that take no weight continues differently."""
    sinkless = gpt_oss_checkpoint(checkpoint_factory, tmp_path_factory, sinks=NO_SINK)
    assert any(hf_greedy(sinkless, p, MAX_TOKENS).token_ids != hf_greedy(model_dir, p, MAX_TOKENS).token_ids
               for p in PROMPTS)


def test_the_window_changes_hf_tokens(checkpoint_factory, tmp_path_factory, model_dir):
    """Guard: every layer attending fully continues differently, so matching HF checks the window."""
    full = gpt_oss_checkpoint(checkpoint_factory, tmp_path_factory, layer_types=["full_attention"] * 4)
    assert hf_greedy(full, LONG_PROMPT, MAX_TOKENS).token_ids != hf_greedy(model_dir, LONG_PROMPT, MAX_TOKENS).token_ids


def test_experts_clamped_swiglu_on_interleaved_gate_up():
    """One expert, by hand: even columns of gate_up are the gate, odd ones the up projection; the
    gate is clamped above, up on both sides, and up enters as (up + 1)."""
    from types import SimpleNamespace

    config = SimpleNamespace(num_local_experts=2, hidden_size=3, intermediate_size=2, swiglu_alpha=1.5,
                             swiglu_limit=2.0)
    experts = GptOssExperts(config)
    for param in experts.parameters():
        param.data.zero_()
    experts.gate_up_proj_bias.data[1] = torch.tensor([5.0, -0.5, -1.0, 9.0])  # gate0, up0, gate1, up1
    experts.down_proj.data[1] = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    out = experts(torch.zeros(1, 3), torch.tensor([[1]]), torch.tensor([[0.5]]))

    def silu_alpha(g: float) -> float:
        return g * torch.sigmoid(torch.tensor(g * 1.5)).item()

    expected = [0.5 * (-0.5 + 1) * silu_alpha(2.0), 0.5 * (2.0 + 1) * silu_alpha(-1.0), 0.0]
    torch.testing.assert_close(out[0], torch.tensor(expected))


# ---- engine paths ---------------------------------------------------------------------------------
def test_batch_of_one_and_of_four_match_hf_with_logprobs(model_dir):
    llm = make_llm(model_dir)
    assert isinstance(llm.engine.core.scheduler.kv_cache_manager, HybridKVCacheManager)
    assert_matches_hf(model_dir, [LONG_PROMPT], llm.generate([LONG_PROMPT], GREEDY_LOGPROBS), check_logprobs=True)
    assert_matches_hf(model_dir, PROMPTS, llm.generate(PROMPTS, GREEDY_LOGPROBS), check_logprobs=True)


def test_chunked_prefill_matches_hf(model_dir):
    llm = make_llm(model_dir, max_num_batched_tokens=13)  # below every prompt but "Hello"
    assert_matches_hf(model_dir, PROMPTS, llm.generate(PROMPTS, GREEDY_LOGPROBS), check_logprobs=True)


def test_preemption_matches_hf(model_dir):
    probe = make_llm(model_dir, kv_cache_memory="1MiB", max_num_batched_tokens=64)
    block_bytes = probe.engine.core.executor.kv_bytes_per_block()
    groups = probe.engine.core.scheduler.kv_cache_manager.groups
    num_blocks = blocks_held(groups, MAX_MODEL_LEN, 64, 16) + 3  # room for the longest request and little else
    llm = make_llm(model_dir, kv_cache_memory=str(num_blocks * block_bytes), max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS * 2, GREEDY_LOGPROBS)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert_matches_hf(model_dir, PROMPTS * 2, outputs, check_logprobs=True)
    assert scheduler.kv_cache_manager.pool.num_used_blocks == 0


def test_warm_prefix_cache_matches_hf(model_dir):
    shared = [LONG_PROMPT[:200] + suffix for suffix in (" and then", "!")]
    prompts = PROMPTS + shared
    llm = make_llm(model_dir, enable_prefix_caching=True, max_num_batched_tokens=64)
    assert_matches_hf(model_dir, prompts, llm.generate(prompts, GREEDY))
    warm = llm.generate(prompts, GREEDY_LOGPROBS)
    assert_matches_hf(model_dir, prompts, warm, check_logprobs=True)
    assert warm[prompts.index(LONG_PROMPT)].num_cached_tokens >= 320
    assert all(out.num_cached_tokens >= 192 for out in warm[len(PROMPTS):])


@pytest.mark.parametrize("backend", ["torch", "torch_ref"])
def test_the_torch_backends_match_hf(model_dir, backend):
    """The default CPU backend sends layers with sinks to the torch paths (tested above); these are them."""
    llm = make_llm(model_dir, attention_backend=backend, max_num_batched_tokens=13)
    assert_matches_hf(model_dir, PROMPTS, llm.generate(PROMPTS, GREEDY_LOGPROBS), check_logprobs=True)


def test_sinks_are_loaded_per_layer_and_fast_paths_say_why_not(model_dir):
    llm = make_llm(model_dir)
    model = llm.engine.core.executor.runner.model
    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    for i, attn in enumerate(model.attention_layers()):
        torch.testing.assert_close(attn.sink_logits.data, saved[f"model.layers.{i}.self_attn.sinks"])
    assert model.fused_decode is None
    assert "fused decode" in model.fused_decode_layers()
    assert all("sink logits" in layer.self_attn.fused_decode_attention() for layer in model.layers)
    assert "experts" in model.cuda_graph_unsupported()


def test_the_transformers_fallback_reads_the_sinks_and_matches_hf(model_dir):
    """HF's own gpt-oss modules over kvtide's paged attention: the sinks they pass (`s_aux`) are the
    kvtide layers' sink logits, chunked prefill and a batch of four included."""
    llm = make_llm(model_dir, model_impl="transformers", max_num_batched_tokens=13)
    model = llm.engine.core.executor.runner.model
    assert type(model).__name__ == "TransformersForCausalLM"
    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    for i, attn in enumerate(model.attention_layers()):
        torch.testing.assert_close(attn.sink_logits.data, saved[f"model.layers.{i}.self_attn.sinks"])
    assert_matches_hf(model_dir, PROMPTS, llm.generate(PROMPTS, GREEDY_LOGPROBS), check_logprobs=True)


# ---- MXFP4 checkpoints ----------------------------------------------------------------------------
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def mxfp4_dirs(model_dir, tmp_path_factory) -> tuple[str, str]:
    """(an MXFP4 checkpoint, the float checkpoint of exactly the values it decodes to): the experts
    of `model_dir` encoded by tests/mxfp4_codec.py (written from the format), stored as gpt-oss
    stores them ((E, out, in / 32, 16) blocks and (E, out, in / 32) scales, with
    quantization_config.quant_method "mxfp4"), and the same decoded values saved as floats for HF."""
    import json

    from mxfp4_codec import encode_mxfp4

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    packed, equivalent = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(EXPERT_WEIGHTS):
            blocks, scales, decoded = encode_mxfp4(tensor.transpose(1, 2))  # (E, out, in)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            equivalent[name] = decoded.transpose(1, 2).contiguous()
        else:
            packed[name] = equivalent[name] = tensor
    assert sum(name.endswith("_blocks") for name in packed) == 2 * CONFIG["num_hidden_layers"]
    dirs = []
    for kind, weights in (("mxfp4", packed), ("mxfp4-decoded", equivalent)):
        path = str(tmp_path_factory.mktemp(f"gptoss-{kind}"))
        shutil.copytree(model_dir, path, dirs_exist_ok=True)
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        dirs.append(path)
    config_path = os.path.join(dirs[0], "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router",
                                                                                         "model.embed_tokens", "lm_head"]}
    with open(config_path, "w") as f:
        json.dump(config, f)
    return dirs[0], dirs[1]


def test_an_mxfp4_checkpoint_matches_hf_on_its_decoded_weights(mxfp4_dirs, model_dir):
    mxfp4_dir, decoded_dir = mxfp4_dirs
    # the encoding is lossy enough to matter: HF's own tokens move with it
    assert any(hf_greedy(decoded_dir, p, MAX_TOKENS).token_ids != hf_greedy(model_dir, p, MAX_TOKENS).token_ids
               for p in PROMPTS)
    llm = make_llm(mxfp4_dir, max_num_batched_tokens=48)
    model = llm.engine.core.executor.runner.model
    assert model.quant_config.name == "mxfp4"
    assert_matches_hf(decoded_dir, PROMPTS, llm.generate(PROMPTS, GREEDY_LOGPROBS), check_logprobs=True)
    # The experts are held as the checkpoint stores them: its uint8 codes and scales, no float copy.
    stored = load_file(os.path.join(mxfp4_dir, "model.safetensors"))
    for i, layer in enumerate(model.layers):
        experts = layer.mlp.experts
        names = {name for name, _ in experts.named_parameters()}
        assert not names & {"gate_up_proj", "down_proj"}
        for name in (f"{w}_{part}" for w in ("gate_up_proj", "down_proj") for part in ("blocks", "scales")):
            held = getattr(experts, name)
            assert held.dtype == torch.uint8 and torch.equal(held, stored[f"model.layers.{i}.mlp.experts.{name}"])
