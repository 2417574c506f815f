"""Gemma 2 and Gemma 3 GGUF files (llama.cpp's `gemma2` / `gemma3` architectures), written with the
`gguf` package's writer from tiny seeded checkpoints as llama.cpp's converter writes them (norm
weights stored as 1 + w), in F32 and Q8_0: kvtide's greedy tokens and chosen-token logprobs against
transformers loading the same file with `gguf_file=`.

transformers' GGUF reader takes from a Gemma file only the Llama-like keys (sizes, head_dim, the
window, the global rope base); the rest it leaves at its config defaults, which are the real models'
values. So the reference is given, as config arguments, what the file holds beyond that (Gemma 2's
soft caps, Gemma 3's linear rope scaling) and llama.cpp's query scale (1/sqrt(head_dim)); the
layer pattern (Gemma 2 alternating, Gemma 3 five sliding of six) and Gemma 3's local rope base
10000 are transformers' own defaults. kvtide's config from the file is checked against the original
checkpoint's, so the conventions it derives are those the checkpoint was built with.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from gguf_writer import build_gemma_checkpoint, write_gguf
from safetensors.torch import load_file, save_file

from kvtide import LLM, SamplingParams
from kvtide.models.gguf_checkpoint import iterate_gguf_weights, prepare_gguf_model_dir

MAX_TOKENS = 12
LOGPROB_TOL = 1e-4
WINDOW = 8
HEAD_DIM = 32
BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
            max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.02)
"""Rows of 64 and 128: whole Q8_0 blocks of 32. query_pre_attn_scalar = head_dim, llama.cpp's scale."""
CONFIGS = {
    "Gemma2ForCausalLM": dict(BASE, num_hidden_layers=4, attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
                              layer_types=["sliding_attention", "full_attention"] * 2),
    "Gemma3ForCausalLM": dict(BASE, num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 50000.0},
                                               "sliding_attention": {"rope_type": "default",
                                                                     "rope_theta": 10000.0}}),
}
QK_GAIN = {"Gemma2ForCausalLM": 8.0, "Gemma3ForCausalLM": 1.0}
"""Gemma 2 has no q/k norms: its q/k scaled up so that attention scores reach the soft cap."""
ARCHS = list(CONFIGS)
PROMPTS = ["The quick brown fox jumps over the lazy dog, then sleeps.",
           "def add(a, b):\n    return a + b\n\nprint(add(3, 4))", "机器学习 🙂 café Zürich", "Hello"]
"""Three of them longer than the window; the emoji and accents through the byte-fallback tokens."""


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch, compiled_cpu_ops):
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path_factory.getbasetemp() / "kvtide-cache"))


def perturb(model_dir: str, qk_gain: float) -> None:
    """Norm weights (offsets from 1, which transformers initializes to 0) to seeded noise, so the
    1 + w the file stores and its undoing are tested; q/k projections times qk_gain."""
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(1)
    for name in sorted(tensors):
        if name.endswith("norm.weight"):
            tensors[name] = torch.randn(tensors[name].shape, generator=generator) * 0.5
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = tensors[name] * qk_gain
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for arch, config in CONFIGS.items():
        path = build_gemma_checkpoint(str(tmp_path_factory.mktemp(arch.lower())), arch, **config)
        perturb(path, QK_GAIN[arch])
        out[arch] = path
    return out


@pytest.fixture(scope="module")
def gguf_files(checkpoints, tmp_path_factory) -> dict[tuple[str, str], str]:
    out = {}
    for arch, ckpt in checkpoints.items():
        for tensor_type in ("F32", "Q8_0"):
            path = str(tmp_path_factory.mktemp("gemma-gguf") / f"{arch.lower()}-{tensor_type}.gguf")
            out[arch, tensor_type] = write_gguf(ckpt, path, tensor_type)
    return out


def reference_overrides(arch: str) -> dict:
    config = CONFIGS[arch]
    overrides = {"query_pre_attn_scalar": HEAD_DIM}
    if arch == "Gemma2ForCausalLM":
        overrides.update(attn_logit_softcapping=config["attn_logit_softcapping"],
                         final_logit_softcapping=config["final_logit_softcapping"])
    else:
        overrides.update(rope_parameters=config["rope_parameters"])
    return overrides


@functools.cache
def hf_from_gguf(path: str, arch: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, **reference_overrides(arch)).eval()
    assert type(model).__name__ == arch
    model.generation_config.eos_token_id = None
    return model


def test_files_hold_llama_cpp_names_and_shifted_norms(checkpoints, gguf_files):
    """Guard: the file is what llama.cpp writes (else the parity below proves little)."""
    from gguf import GGUFReader

    reference = load_file(os.path.join(checkpoints["Gemma3ForCausalLM"], "model.safetensors"))
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in GGUFReader(gguf_files["Gemma3ForCausalLM", "F32"]).tensors}
    for gguf_name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "attn_q_norm", "attn_k_norm"):
        assert f"blk.0.{gguf_name}.weight" in stored, gguf_name
    assert "output.weight" not in stored  # tied
    assert torch.equal(stored["blk.0.ffn_norm.weight"], reference["model.layers.0.pre_feedforward_layernorm.weight"] + 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_gives_back_the_checkpoint_weights(checkpoints, gguf_files, arch):
    reference = load_file(os.path.join(checkpoints[arch], "model.safetensors"))
    loaded = dict(iterate_gguf_weights(gguf_files[arch, "F32"]))
    assert set(loaded) == set(reference)
    for name, tensor in reference.items():
        if name.endswith("norm.weight"):  # (w + 1) - 1 in float32
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=1e-6, msg=name)
        else:
            assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("arch", ARCHS)
def test_config_from_the_file_is_the_checkpoints(checkpoints, gguf_files, arch):
    """What the file holds and what kvtide derives as llama.cpp does give the checkpoint's config."""
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(prepare_gguf_model_dir(gguf_files[arch, "Q8_0"]))
    theirs = AutoConfig.from_pretrained(checkpoints[arch])
    assert type(ours) is type(theirs)
    for field in ("layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_parameters", "hidden_activation", "tie_word_embeddings",
                  "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # float32 in the file


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_matches_transformers_loading_the_same_file(gguf_files, arch, tensor_type):
    path = gguf_files[arch, tensor_type]
    llm = LLM(model=path, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
    model = llm.engine.core.executor.runner.model
    assert type(model).__name__ == arch
    if tensor_type == "Q8_0":  # kept quantized, as the file holds them
        layer = model.layers[0]
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert linear.quantized is not None and linear.quantized.kind == "int8"
    hf = hf_from_gguf(path, arch)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS, params)
    assert sum(len(out.prompt_token_ids) > WINDOW for out in outputs) >= 3
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens = ref.sequences[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == tokens, f"{prompt!r}: kvtide {out.outputs[0].token_ids} != HF {tokens}"
        assert len(set(tokens)) > 2, tokens  # not a degenerate repeat
        logprobs = torch.cat(ref.logits).float().log_softmax(-1)
        for step, (token, lp) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
            assert abs(lp[token].logprob - logprobs[step, token].item()) < LOGPROB_TOL, (prompt, step)


def test_llama_cpp_conventions_for_keys_a_file_lacks():
    """llama.cpp's fixed choices, where the file says nothing: the 27B models (by block count) scale
    queries by hidden / heads, not head_dim; a Gemma 3 file without a window attends fully in every
    layer; a Gemma 2 file without its keys gets llama.cpp's window 4096 and caps 50 / 30."""
    from kvtide.models.gguf_checkpoint import gemma_config

    def keys(values):
        return lambda name, default=None: values.get(name, default)

    config = {"num_hidden_layers": 62, "head_dim": 128, "hidden_size": 5376, "num_attention_heads": 32,
              "rope_theta": 1e6}
    gemma3_27b = gemma_config("gemma3", keys({"attention.sliding_window": 1024}), config, "f.gguf")
    assert gemma3_27b["query_pre_attn_scalar"] == 168
    assert gemma3_27b["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert gemma3_27b["final_logit_softcapping"] is None
    no_window = gemma_config("gemma3", keys({}), dict(config, num_hidden_layers=26), "f.gguf")
    assert no_window["query_pre_attn_scalar"] == 128
    assert no_window["layer_types"] == ["full_attention"] * 26 and no_window["sliding_window"] is None
    gemma2 = gemma_config("gemma2", keys({}), dict(config, num_hidden_layers=42), "f.gguf")
    assert gemma2["sliding_window"] == 4096 and gemma2["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (50.0, 30.0)
    with pytest.raises(ValueError, match="rotary scaling 'yarn'"):
        gemma_config("gemma3", keys({"rope.scaling.type": "yarn"}), config, "f.gguf")


def test_other_architectures_are_refused_naming_the_gemma_ones(tmp_path):
    from gguf import GGUFWriter

    path = str(tmp_path / "gemma1.gguf")
    writer = GGUFWriter(path, "gemma")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gemma' model; kvtide serves the GGUF architectures .*gemma2, gemma3"):
        LLM(model=path, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory="1MiB")
