"""gpt-oss GGUF files (llama.cpp's `gpt-oss` architecture), written here with the `gguf` package's
writer from the tiny seeded gpt-oss checkpoint of test_gpt_oss.py as llama.cpp's converter writes
them: gate_up_proj (E, H, 2I, gate and up interleaved) split into ffn_gate_exps / ffn_up_exps as
(E, I, H) rows, down_proj transposed to ffn_down_exps, the router as ffn_gate_inp, sinks as
attn_sinks, YaRN and the experts in the metadata, the tokenizer and chat template in the file.

The reference is transformers on the checkpoint itself (no GGUF reader in between): an F32 file must
give its greedy tokens and logprobs; a file whose experts are MXFP4 (gguf's own quantizer) must give
those of the float checkpoint holding exactly the values gguf's dequantizer decodes them to, with
the experts held 4-bit by kvtide.

The checkpoint's tokenizer is a byte-level BPE with merges (gguf_writer.build_bpe_checkpoint):
llama.cpp's gpt2 tokenizer keys need merges, and the byte tokenizer of test_gpt_oss.py has none.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize
from gguf_writer import _add_tokenizer, build_bpe_checkpoint
from hf_reference import hf_greedy
from safetensors.torch import load_file, save_file
from test_gpt_oss import (
    ARCH,
    CONFIG,
    GREEDY_LOGPROBS,
    MAX_TOKENS,
    PROMPTS,
    WINDOW,
    assert_matches_hf,
    make_llm,
    perturb_weights,
)

from kvtide.layers.quantization.mxfp4 import dequantize_expert_weight
from kvtide.models.gguf_checkpoint import iterate_gguf_weights, prepare_gguf_model_dir

GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "post_attention_norm.weight",
               "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
               "mlp.router.bias": "ffn_gate_inp.bias",
               **{f"self_attn.{p}_proj.{k}": f"attn_{g}.{k}" for p, g in
                  (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for k in ("weight", "bias")}}
"""transformers name -> llama.cpp's (gguf's TensorNameMap for gpt-oss, sinks given a .weight)."""


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch, compiled_cpu_ops):
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path_factory.getbasetemp() / "kvtide-cache"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """test_gpt_oss.py's checkpoint (its CONFIG and seeded noise on sinks, biases and norms) over a
    byte-level BPE tokenizer."""
    path = build_bpe_checkpoint(str(tmp_path_factory.mktemp("gptoss-bpe")), ARCH, **CONFIG)
    perturb_weights(path, None)
    return path


def llama_cpp_expert_tensors(name: str, tensor: np.ndarray) -> dict[str, np.ndarray]:
    """convert_hf_to_gguf.py's GptOssModel on one float expert tensor: the weights transposed to
    (E, out, in), gate_up's even rows/columns the gate and odd ones up."""
    layer = name.split(".")[2]
    kind = name.rsplit(".", 1)[1]
    if kind == "gate_up_proj_bias":
        return {f"blk.{layer}.ffn_gate_exps.bias": tensor[..., 0::2], f"blk.{layer}.ffn_up_exps.bias": tensor[..., 1::2]}
    if kind == "down_proj_bias":
        return {f"blk.{layer}.ffn_down_exps.bias": tensor}
    weight = tensor.transpose(0, 2, 1)  # (E, out, in)
    if kind == "gate_up_proj":
        return {f"blk.{layer}.ffn_gate_exps.weight": weight[:, 0::2], f"blk.{layer}.ffn_up_exps.weight": weight[:, 1::2]}
    return {f"blk.{layer}.ffn_down_exps.weight": weight}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def write_gpt_oss_gguf(checkpoint_dir: str, path: str, experts: str = "F32", fuse_gate_up: bool = False
                       ) -> tuple[str, dict[str, torch.Tensor]]:
    """(the file, the transformers tensors it decodes to): `experts` "MXFP4" quantizes the expert
    weights with gguf's quantizer; `fuse_gate_up` writes llama.cpp's fused ffn_gate_up_exps ([gate; up]
    rows) instead of the two tensors."""
    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        config = json.load(f)
    rope = config["rope_parameters"]
    writer = GGUFWriter(path, "gpt-oss")
    writer.add_name("tiny-gpt-oss")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    _add_tokenizer(writer, checkpoint_dir, None)

    weights = load_file(os.path.join(checkpoint_dir, "model.safetensors"))
    decoded = dict(weights)
    for hf_name in sorted(weights):
        tensor = weights[hf_name].numpy()
        if ".mlp.experts." not in hf_name:
            writer.add_tensor(gguf_tensor_name(hf_name), tensor)
            continue
        parts = llama_cpp_expert_tensors(hf_name, tensor)
        if fuse_gate_up and len(parts) == 2:
            (gate_name, gate), (_, up) = parts.items()
            parts = {gate_name.replace("ffn_gate_exps", "ffn_gate_up_exps"): np.concatenate((gate, up), axis=1)}
        if experts == "MXFP4" and not hf_name.endswith("_bias"):
            values = []
            for name, weight in parts.items():
                blocks = quantize(np.ascontiguousarray(weight), GGMLQuantizationType.MXFP4)
                writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType.MXFP4)
                values.append(dequantize(blocks, GGMLQuantizationType.MXFP4).reshape(weight.shape))
            if len(values) == 2:  # back to transformers' interleaved (E, H, 2I)
                interleaved = np.stack(values, axis=2).reshape(values[0].shape[0], -1, values[0].shape[2])
                decoded[hf_name] = torch.from_numpy(interleaved.transpose(0, 2, 1).copy())
            else:
                decoded[hf_name] = torch.from_numpy(values[0].transpose(0, 2, 1).copy())
        else:
            for name, part in parts.items():
                writer.add_tensor(name, np.ascontiguousarray(part))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, decoded


@pytest.fixture(scope="module")
def f32_gguf(checkpoint, tmp_path_factory) -> str:
    return write_gpt_oss_gguf(checkpoint, str(tmp_path_factory.mktemp("gptoss-f32") / "tiny-f32.gguf"))[0]


@pytest.fixture(scope="module")
def mxfp4_files(checkpoint, tmp_path_factory) -> tuple[str, str]:
    """(the MXFP4 GGUF, a float checkpoint of exactly the values its experts decode to)."""
    path, decoded = write_gpt_oss_gguf(checkpoint, str(tmp_path_factory.mktemp("gptoss-mxfp4") / "tiny-mxfp4.gguf"),
                                       experts="MXFP4")
    decoded_dir = str(tmp_path_factory.mktemp("gptoss-mxfp4-decoded"))
    for name in os.listdir(checkpoint):
        if name != "model.safetensors":
            with open(os.path.join(checkpoint, name), "rb") as src, open(os.path.join(decoded_dir, name), "wb") as dst:
                dst.write(src.read())
    save_file(decoded, os.path.join(decoded_dir, "model.safetensors"), metadata={"format": "pt"})
    return path, decoded_dir


def test_the_file_holds_llama_cpp_names_and_types(f32_gguf, mxfp4_files):
    """Guard: the names are gguf's own for gpt-oss, the experts split and MXFP4 where asked."""
    from gguf import GGUFReader
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    allowed = {TENSOR_NAMES[t].format(bid=i) for t in MODEL_TENSORS[MODEL_ARCH.GPT_OSS]
               for i in range(CONFIG["num_hidden_layers"])}
    for path in (f32_gguf, mxfp4_files[0]):
        tensors = {t.name: t for t in GGUFReader(path).tensors}
        assert {name.rsplit(".", 1)[0] for name in tensors} == allowed
        assert "blk.0.ffn_gate_exps.bias" in tensors and "blk.0.attn_sinks.weight" in tensors
    types = {t.name: t.tensor_type.name for t in GGUFReader(mxfp4_files[0]).tensors}
    assert types["blk.1.ffn_up_exps.weight"] == "MXFP4" and types["blk.1.ffn_down_exps.weight"] == "MXFP4"
    assert types["blk.1.ffn_up_exps.bias"] == "F32" and types["blk.1.attn_q.weight"] == "F32"


@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_f32_gguf_gives_back_the_checkpoint_weights(checkpoint, tmp_path, fuse_gate_up):
    path, _ = write_gpt_oss_gguf(checkpoint, str(tmp_path / "tiny.gguf"), fuse_gate_up=fuse_gate_up)
    reference = load_file(os.path.join(checkpoint, "model.safetensors"))
    loaded = dict(iterate_gguf_weights(path))
    assert set(loaded) == set(reference)
    for name, tensor in reference.items():
        assert loaded[name].shape == tensor.shape and torch.equal(loaded[name], tensor), name


def test_config_from_the_file_is_the_checkpoints(checkpoint, f32_gguf):
    from transformers import AutoConfig, AutoTokenizer

    prepared = prepare_gguf_model_dir(f32_gguf)
    ours = AutoConfig.from_pretrained(prepared)
    theirs = AutoConfig.from_pretrained(checkpoint)
    assert type(ours) is type(theirs)
    for field in ("layer_types", "sliding_window", "rope_parameters", "head_dim", "num_local_experts",
                  "num_experts_per_tok", "intermediate_size", "swiglu_limit", "attention_bias", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings",
                  "max_position_embeddings", "hidden_size"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # float32 in the file
    tokenizer, reference = AutoTokenizer.from_pretrained(prepared), AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.chat_template == reference.chat_template and tokenizer.chat_template
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)


def test_f32_gguf_matches_hf_in_a_chunked_batch_of_four(checkpoint, f32_gguf):
    llm = make_llm(f32_gguf, max_num_batched_tokens=13)  # below every prompt but "Hello"
    model = llm.engine.core.executor.runner.model
    assert type(model).__name__ == ARCH and getattr(model, "quant_config", None) is None
    outputs = llm.generate(PROMPTS, GREEDY_LOGPROBS)
    assert sum(len(out.prompt_token_ids) > WINDOW for out in outputs) >= 3
    # the long prompt passes YaRN's original context, so the file's rope scaling is exercised
    assert max(len(out.prompt_token_ids) for out in outputs) > CONFIG["rope_parameters"]["original_max_position_embeddings"]
    assert_matches_hf(checkpoint, PROMPTS, outputs, check_logprobs=True)
    assert all(len(set(out.outputs[0].token_ids)) >= 4 for out in outputs)  # not a degenerate repeat


def test_mxfp4_gguf_matches_hf_on_its_dequantized_weights_with_experts_held_4_bit(checkpoint, mxfp4_files):
    path, decoded_dir = mxfp4_files
    # the quantization is lossy enough to matter: HF's own tokens move with it
    assert any(hf_greedy(decoded_dir, p, MAX_TOKENS).token_ids != hf_greedy(checkpoint, p, MAX_TOKENS).token_ids
               for p in PROMPTS)
    llm = make_llm(path, max_num_batched_tokens=48)
    model = llm.engine.core.executor.runner.model
    assert model.quant_config.name == "gguf"
    assert_matches_hf(decoded_dir, PROMPTS, llm.generate(PROMPTS, GREEDY_LOGPROBS), check_logprobs=True)
    decoded = load_file(os.path.join(decoded_dir, "model.safetensors"))
    for i, layer in enumerate(model.layers):
        experts = layer.mlp.experts
        assert experts.mxfp4 and not {n for n, _ in experts.named_parameters()} & {"gate_up_proj", "down_proj"}
        for weight in ("gate_up_proj", "down_proj"):
            blocks, scales = getattr(experts, f"{weight}_blocks"), getattr(experts, f"{weight}_scales")
            assert blocks.dtype == scales.dtype == torch.uint8
            assert torch.equal(dequantize_expert_weight(blocks, scales, torch.float32),
                               decoded[f"model.layers.{i}.mlp.experts.{weight}"])


def test_mxfp4_gguf_exports_the_float_checkpoint_it_decodes_to(mxfp4_files):
    """The float export (for engines that read only safetensors) holds the decoded experts."""
    from kvtide.models.gguf_checkpoint import export_hf_checkpoint

    path, decoded_dir = mxfp4_files
    exported = export_hf_checkpoint(path, os.path.join(os.environ["KVTIDE_CACHE"], "export-gptoss-mxfp4"))
    weights = load_file(os.path.join(exported, "model.safetensors"))
    decoded = load_file(os.path.join(decoded_dir, "model.safetensors"))
    assert set(weights) == set(decoded)
    assert all(torch.equal(weights[name], decoded[name]) for name in decoded)


def test_other_architectures_are_refused_naming_gpt_oss(tmp_path):
    path = str(tmp_path / "falcon.gguf")
    writer = GGUFWriter(path, "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'falcon' model; kvtide serves the GGUF architectures .*gpt-oss"):
        prepare_gguf_model_dir(path)
