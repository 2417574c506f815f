"""GGUF checkpoints (llama.cpp's format): metadata -> an HF-style model directory, tensors -> HF names.

A GGUF file carries everything: config keys, the tokenizer (vocab, merges, special tokens), the chat
template and the (often quantized) tensors. `prepare_gguf_model_dir` turns the metadata into a small
cached directory (config.json, generation_config.json, tokenizer files, a marker naming the file), so
the rest of the engine loads a GGUF model as it loads any checkpoint; the weights are not copied:
`iterate_gguf_weights` streams them from the file, renamed to transformers' names and with
llama.cpp's rotary permutation of q/k undone (and, for Gemma, the 1 its converter adds to every norm
weight taken off again; for gpt-oss, its split expert tensors fused back into transformers' interleaved
gate_up layout, see gpt_oss_expert_tensors). Quantized linears and embeddings stay quantized
(their block codes decoded into the engine's layout, layers/quantization/gguf.py); the rest is
dequantized with the `gguf` package's own kernels.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvtide.models.cache_dir import build_cached_dir, cache_dir, private_cache_path

MARKER = "kvtide_gguf.json"
"""File in a prepared directory naming the GGUF its weights come from."""
FORMAT_VERSION = "3"
"""Bumped when the prepared directory's contents change, so stale caches are rebuilt."""

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "gpt-oss": "GptOssForCausalLM"}
"""GGUF general.architecture -> the transformers architecture kvtide serves it as."""

DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                     "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")
"""Tensor types kvtide reads: the quantized ones stay quantized in the linears and the token table
(layers/quantization/gguf.py); any other tensor of them is dequantized on load to the engine dtype
(gpt-oss's MXFP4 experts are held as stored where the model can, see gpt_oss_expert_tensors)."""

_PERMUTED_ARCHITECTURES = ("llama", "mistral")
"""llama.cpp's converter interleaves the rotary halves of q/k for these (its 'normal' rope); Qwen
models use the NeoX layout, which is transformers' own, and are stored as they are."""

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER_TENSORS = dict(_LAYER_TENSORS, post_attention_norm="post_attention_layernorm",
                            ffn_norm="pre_feedforward_layernorm", post_ffw_norm="post_feedforward_layernorm")
"""Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP, not after attention."""
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
GEMMA_NORM_SHIFT = 1.0
"""llama.cpp's converter stores a Gemma norm weight w as 1 + w (its RMSNorm scales by the weight
itself; transformers' and kvtide's Gemma norms scale by 1 + w), so it is subtracted on load."""
_FUSED_LAYER_TENSORS = {"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                        "ffn_up": ("mlp.gate_proj", "mlp.up_proj")}
"""Phi-3's fused tensors, by row blocks: attn_qkv is [q; k; v], its ffn_up [gate; up]."""
_GPT_OSS_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate_inp": "mlp.router",
}
"""gpt-oss's norm before the MoE is llama.cpp's post_attention_norm; its router is ffn_gate_inp."""
GPT_OSS_SINKS = "attn_sinks"
_GPT_OSS_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


def is_gguf_file(path: str) -> bool:
    return path.lower().endswith(".gguf")


def open_gguf(path: str):
    """A GGUFReader, or one ValueError that names the file and what is wrong with it."""
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    try:
        return GGUFReader(path)
    except Exception as e:  # truncated or corrupt: numpy reads past the end, bad lengths, ...
        raise ValueError(f"cannot read GGUF file {path} ({type(e).__name__}: {e}): the file is truncated "
                         f"or corrupt; download or convert it again") from e


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF file {path} holds a {arch!r} model; kvtide serves the GGUF architectures "
                         f"{', '.join(ARCHITECTURES)}")
    return arch


def check_tensor_types(reader, path: str) -> None:
    unsupported = sorted({t.tensor_type.name for t in reader.tensors} - set(DEQUANTIZED_TYPES))
    if unsupported:
        raise ValueError(f"GGUF file {path} has tensors of type {', '.join(unsupported)}, which kvtide cannot "
                         f"load; supported: {', '.join(DEQUANTIZED_TYPES)}")


def hf_config_dict(reader, path: str) -> dict[str, Any]:
    """transformers config.json contents from the GGUF metadata."""
    arch = gguf_architecture(reader, path)

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    tensor_names = {t.name for t in reader.tensors}
    num_heads = key("attention.head_count")
    hidden = key("embedding_length")
    if num_heads is None or hidden is None or key("block_count") is None:
        raise ValueError(f"GGUF file {path} lacks {arch}.embedding_length, .block_count or "
                         f".attention.head_count: not a complete model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if arch == "phi3":  # rope.dimension_count is the rotated part of the head
        head_dim = key("attention.key_length") or hidden // num_heads
    else:
        head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "vocab_size": key("vocab_size") or (len(tokens) if tokens is not None else None),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if key("attention.sliding_window"):  # llama.cpp writes 0 for none
        config["sliding_window"] = key("attention.sliding_window")
    if arch == "phi3":
        config.update(phi3_rope_config(reader, key, config, head_dim, path))
    if arch in GEMMA_ARCHITECTURES:
        config.update(gemma_config(arch, key, config, path))
    elif arch == "gpt-oss":
        config.update(gpt_oss_config(key, config, tensor_names, path))
    elif key("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"GGUF file {path} uses rotary scaling {key('rope.scaling.type')!r}, which kvtide does "
                         f"not read from GGUF yet; serve the Hugging Face checkpoint instead")
    if "rope_freqs.weight" in tensor_names:
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        if factors.tensor_type.name != "F32":
            raise ValueError(f"GGUF file {path}: rope_freqs.weight is {factors.tensor_type.name}, expected F32")
        rope = llama3_rope_from_factors(np.asarray(factors.data, dtype=np.float64), config["rope_theta"],
                                        head_dim, key("rope.scaling.original_context_length") or 8192, path)
        if rope is not None:
            config["rope_parameters"] = dict(rope, rope_theta=config["rope_theta"])
    for name, gguf_name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                            ("pad_token_id", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{gguf_name}")
        if value is not None:
            config[name] = int(value)
    if config["vocab_size"] is None:
        raise ValueError(f"GGUF file {path} has neither {arch}.vocab_size nor a tokenizer vocabulary")
    return config


GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""Block counts llama.cpp takes for the 27B models, whose query scale is 1/sqrt(hidden / heads)."""


def gemma_config(arch: str, key, config: dict[str, Any], path: str) -> dict[str, Any]:
    """Gemma 2 / 3 fields of transformers' config. The file holds the sliding window, the soft caps
    (Gemma 2) and the global rope (Gemma 3); the rest llama.cpp fixes by convention, so it is derived
    here as llama.cpp does: the query scale is 1/sqrt(head_dim) except for the 27B models (by block
    count) where it is 1/sqrt(hidden / heads); every other layer is sliding in Gemma 2, five of every
    six in Gemma 3 (none without a window), whose sliding layers rotate with base 10000 and no scaling.
    llama.cpp's defaults fill keys a file lacks: Gemma 2's window 4096 and caps 50 (attention) and 30
    (logits); Gemma 3 caps nothing unless final_logit_softcapping is given."""
    n_layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    out: dict[str, Any] = {"model_type": "gemma2" if arch == "gemma2" else "gemma3_text",
                           "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    is_27b = n_layers == GEMMA_27B_LAYERS[arch]
    out["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if is_27b else head_dim
    window = key("attention.sliding_window")
    if arch == "gemma2":
        window = 4096 if window is None else window
        out["attn_logit_softcapping"] = float(key("attn_logit_softcapping", 50.0))
        out["final_logit_softcapping"] = float(key("final_logit_softcapping", 30.0))
    else:
        final_cap = key("final_logit_softcapping")
        out["attn_logit_softcapping"] = None
        out["final_logit_softcapping"] = float(final_cap) if final_cap else None
    pattern = 2 if arch == "gemma2" else 6
    out["sliding_window"] = window or None
    out["layer_types"] = ["sliding_attention" if window and (i + 1) % pattern else "full_attention"
                          for i in range(n_layers)]
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none") and (arch == "gemma2" or scaling != "linear"):
        raise ValueError(f"GGUF file {path} uses rotary scaling {scaling!r}, which kvtide does not read from "
                         f"a {arch} GGUF; serve the Hugging Face checkpoint instead")
    if arch == "gemma3":
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
        if scaling == "linear":
            full.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
        out["rope_parameters"] = {"full_attention": full,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return out


GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SWIGLU_ALPHA = 1.702
"""The experts' clamp and sigmoid gain: not in a gpt-oss GGUF, fixed in llama.cpp as in the released models."""


def gpt_oss_config(key, config: dict[str, Any], tensor_names: set[str], path: str) -> dict[str, Any]:
    """gpt-oss fields of transformers' config. The file holds the experts (count, top-k, their inner
    size), the window and YaRN's factor, original context and betas; llama.cpp fixes the rest: layers
    alternate sliding then full (layer 0 sliding, as transformers' default `layer_types`), the SwiGLU
    clamp 7 and gain 1.702. YaRN is taken untruncated (`truncate: false`), as the released checkpoints
    declare it; an attention factor is kept only where the file gives one (else transformers derives it)."""
    experts, used = key("expert_count"), key("expert_used_count")
    if not experts or not used:
        raise ValueError(f"GGUF file {path} lacks gpt-oss.expert_count or .expert_used_count: not a complete model")
    window = key("attention.sliding_window")
    out: dict[str, Any] = {
        "model_type": "gpt_oss", "num_local_experts": int(experts), "num_experts_per_tok": int(used),
        "intermediate_size": int(key("expert_feed_forward_length") or config["intermediate_size"]),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "swiglu_limit": GPT_OSS_SWIGLU_LIMIT, "swiglu_alpha": GPT_OSS_SWIGLU_ALPHA,
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if window and i % 2 == 0 else "full_attention"
                        for i in range(config["num_hidden_layers"])],
    }
    scaling = key("rope.scaling.type")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(key("rope.scaling.factor")),
                    original_max_position_embeddings=int(key("rope.scaling.original_context_length")
                                                         or config["max_position_embeddings"]),
                    beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)), truncate=False)
        attention_factor = key("rope.scaling.yarn_attn_factor")
        if attention_factor is not None:
            rope["attention_factor"] = float(attention_factor)
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF file {path} uses rotary scaling {scaling!r}, which kvtide does not read from a "
                         f"gpt-oss GGUF; serve the Hugging Face checkpoint instead")
    out["rope_parameters"] = rope
    return out


def phi3_rope_config(reader, key, config: dict[str, Any], head_dim: int, path: str) -> dict[str, Any]:
    """Phi-3's partial rotary (rope.dimension_count of the head) and LongRoPE (the short and long
    factors as tensors, the original context and attention factor as keys) as transformers' config."""
    out: dict[str, Any] = {}
    rotary_dim = key("rope.dimension_count") or head_dim
    if rotary_dim != head_dim:
        out["partial_rotary_factor"] = rotary_dim / head_dim
    tensors = {t.name: t for t in reader.tensors if t.name in _LONGROPE_TENSORS}
    if not tensors:
        return out
    if len(tensors) != 2:
        raise ValueError(f"GGUF file {path} has {', '.join(tensors)} but not both LongRoPE factor tensors")
    factors = {}
    for name, tensor in tensors.items():
        if tensor.tensor_type.name != "F32" or int(np.prod(tensor.shape)) != rotary_dim // 2:
            raise ValueError(f"GGUF file {path}: {name} is {tensor.tensor_type.name} of {int(np.prod(tensor.shape))} "
                             f"entries, expected F32 of {rotary_dim // 2}")
        factors[name] = [float(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]
    original = int(key("rope.scaling.original_context_length") or config["max_position_embeddings"])
    rope: dict[str, Any] = {"rope_type": "longrope", "rope_theta": config["rope_theta"],
                            "long_factor": factors["rope_factors_long.weight"],
                            "short_factor": factors["rope_factors_short.weight"],
                            "original_max_position_embeddings": original}
    # llama.cpp stores the attention factor transformers derives from the two lengths (in float32):
    # kept only where it is another value, so the derived one is used bit for bit.
    scale = config["max_position_embeddings"] / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    stored = key("rope.scaling.attn_factor")
    if stored is not None and abs(float(stored) - derived) > 1e-6 * derived:
        rope["attention_factor"] = float(stored)
    if rotary_dim != head_dim:
        rope["partial_rotary_factor"] = rotary_dim / head_dim
    out.update(rope_parameters=rope, original_max_position_embeddings=original)
    return out


def llama3_rope_from_factors(factors: np.ndarray, base: float, head_dim: int, original_context: int,
                             path: str) -> dict[str, Any] | None:
    """transformers' llama3 rope parameters from llama.cpp's `rope_freqs` tensor (one divisor per
    frequency: 1 for short wavelengths, `factor` for long ones, a smooth blend in between).

    In the band, s = (1/f_i - 1/factor) / (1 - 1/factor) is linear in 1/wavelength: s = A / wavelen + B with
    A = original / (high - low) and B = -low / (high - low). Only A and B shape the table, so with the
    original context fixed (from the file, else Llama 3's 8192) the two factors follow exactly."""
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if len(factors) != len(inv_freq):
        raise ValueError(f"GGUF file {path}: rope_freqs has {len(factors)} entries, expected {len(inv_freq)}")
    wavelen = 2 * np.pi / inv_freq
    band = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6 * factor)
    if band.sum() < 2:
        raise ValueError(f"GGUF file {path}: cannot recover llama3 rope scaling from rope_freqs (fewer than two "
                         f"frequencies in its smoothing band); serve the Hugging Face checkpoint instead")
    smooth = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(1.0 / wavelen[band], smooth, 1)
    width = original_context / slope  # high - low
    low = -intercept * width
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
            "high_freq_factor": float(low + width), "original_max_position_embeddings": int(original_context)}


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = _GEMMA_LAYER_TENSORS if arch in GEMMA_ARCHITECTURES else _LAYER_TENSORS
    parts = gguf_name.split(".")
    if arch == "gpt-oss":
        layer_tensors = _GPT_OSS_LAYER_TENSORS
        if len(parts) == 4 and parts[0] == "blk" and parts[2] == GPT_OSS_SINKS and parts[3] == "weight":
            return f"model.layers.{parts[1]}.self_attn.sinks"  # transformers' parameter has no .weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{parts[3]}"
    return None


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, its (2, dim/2) interleave back to the two halves."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def tensor_index(reader, path: str) -> list[dict[str, Any]]:
    """Where each tensor lies in the file, under its transformers name, with how to undo the q/k
    permutation: recorded once, so later loads read the weights without parsing the metadata again
    (GGUFReader spends seconds on a 50k-token vocabulary). Checks the architecture and tensor types."""
    arch = gguf_architecture(reader, path)
    check_tensor_types(reader, path)
    num_heads = _field(reader, f"{arch}.attention.head_count")
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv", num_heads)
    index = []
    experts: dict[tuple[int, str], dict[str, Any]] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight" or tensor.name in _LONGROPE_TENSORS:  # read into the config
            continue
        parts = tensor.name.split(".")
        if arch == "phi3" and len(parts) == 4 and parts[2] in _FUSED_LAYER_TENSORS:
            index.extend(_fused_row_blocks(reader, tensor, arch, path))
            continue
        if arch == "gpt-oss" and len(parts) == 4 and parts[2] in _GPT_OSS_EXPERT_TENSORS:
            experts.setdefault((int(parts[1]), parts[3]), {})[parts[2]] = tensor
            continue
        name = _hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"GGUF file {path}: tensor {tensor.name!r} has no place in a {arch} model")
        heads = None
        if arch in _PERMUTED_ARCHITECTURES and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
        entry = {"name": name, "gguf_name": tensor.name, "type": tensor.tensor_type.name,
                 "shape": [int(d) for d in reversed(tensor.shape)], "offset": int(tensor.data_offset),
                 "nbytes": int(tensor.n_bytes), "permute_heads": heads}
        if arch in GEMMA_ARCHITECTURES and tensor.name.endswith("norm.weight"):
            entry["subtract"] = GEMMA_NORM_SHIFT
        index.append(entry)
    for (layer, suffix), tensors in sorted(experts.items()):
        index.extend(_gpt_oss_expert_entries(layer, suffix, tensors, path))
    return index


def _gpt_oss_expert_entries(layer: int, suffix: str, tensors: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """Index entries for one layer's expert weights (or biases): transformers' fused gate_up from
    llama.cpp's ffn_gate_exps and ffn_up_exps (or its fused ffn_gate_up_exps, [gate; up] by rows),
    and down_proj from ffn_down_exps. Each entry lists the file's tensors it is made of."""
    prefix = f"model.layers.{layer}.mlp.experts."
    name_of = {"down": "down_proj", "gate_up": "gate_up_proj"}
    found = dict(tensors)
    groups = []
    if "ffn_down_exps" in found:
        groups.append(("down", [found.pop("ffn_down_exps")]))
    if "ffn_gate_up_exps" in found:
        groups.append(("gate_up", [found.pop("ffn_gate_up_exps")]))
    elif "ffn_gate_exps" in found and "ffn_up_exps" in found:
        groups.append(("gate_up", [found.pop("ffn_gate_exps"), found.pop("ffn_up_exps")]))
    if found:
        raise ValueError(f"GGUF file {path}: {', '.join(t.name for t in found.values())} without the expert "
                         f"tensors it pairs with (ffn_gate_exps with ffn_up_exps)")
    entries = []
    for layout, parts in groups:
        types = [t.tensor_type.name for t in parts]
        shapes = [[int(d) for d in reversed(t.shape)] for t in parts]
        if len({tuple(shape) for shape in shapes}) != 1:
            raise ValueError(f"GGUF file {path}: {' and '.join(t.name for t in parts)} differ in shape ({shapes})")
        name = prefix + name_of[layout] + ("_bias" if suffix == "bias" else "")
        entries.append({"name": name, "gguf_name": " + ".join(t.name for t in parts),
                        "type": types[0] if len(set(types)) == 1 else "+".join(types),
                        "permute_heads": None, "expert_layout": layout,
                        "parts": [{"gguf_name": t.name, "type": t.tensor_type.name, "shape": shape,
                                   "offset": int(t.data_offset), "nbytes": int(t.n_bytes)}
                                  for t, shape in zip(parts, shapes, strict=True)]})
    return entries


def _fused_row_blocks(reader, tensor, arch: str, path: str) -> list[dict[str, Any]]:
    """Index entries for each row block of a fused tensor (attn_qkv, Phi-3's ffn_up), under the
    unfused transformers names. A GGUF row is whole quantization blocks, so each block of rows is
    its own byte range of the file: the blocks stay quantized where the layer keeps them so."""
    _, layer, kind, suffix = tensor.name.split(".")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv", num_heads)
    shape = [int(d) for d in reversed(tensor.shape)]
    rows = shape[0]
    if kind == "attn_qkv":
        head_dim = rows // (num_heads + 2 * num_kv_heads)
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    else:
        sizes = [rows // 2, rows // 2]
    if sum(sizes) != rows:
        raise ValueError(f"GGUF file {path}: {tensor.name} has {rows} rows, which do not split into "
                         f"{' + '.join(_FUSED_LAYER_TENSORS[kind])}")
    row_bytes = int(tensor.n_bytes) // rows
    entries, start = [], 0
    for module, size in zip(_FUSED_LAYER_TENSORS[kind], sizes, strict=True):
        entries.append({"name": f"model.layers.{layer}.{module}.{suffix}", "gguf_name": f"{tensor.name} ({module})",
                        "type": tensor.tensor_type.name, "shape": [size, *shape[1:]],
                        "offset": int(tensor.data_offset) + start * row_bytes, "nbytes": size * row_bytes,
                        "permute_heads": None})
        start += size
    return entries


def iterate_gguf_weights(path: str, index: list[dict[str, Any]] | None = None,
                         kept: dict[str, tuple[str, int, bool]] | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, float32 tensor) for each tensor of the file, dequantized with gguf's kernels;
    a tensor named in `kept` (name -> the (kind, group size, has mins) its layer keeps) comes as its
    codes, scales and mins instead (`<module>.gguf_codes`, `.gguf_scales`, `.gguf_mins`)."""
    from gguf import GGMLQuantizationType, dequantize

    if index is None:
        index = tensor_index(open_gguf(path), path)
    data = np.memmap(path, mode="r")
    for entry in index:
        if "parts" in entry:
            yield from gpt_oss_expert_tensors(path, data, entry)
            continue
        raw = data[entry["offset"]:entry["offset"] + entry["nbytes"]]
        if len(raw) != entry["nbytes"]:
            raise ValueError(f"GGUF file {path} ends inside tensor {entry['gguf_name']}: the file is truncated; "
                             f"download or convert it again")
        shape = entry["shape"]
        if kept is not None and entry["name"] in kept:
            yield from _kept_quantized(path, entry, raw, kept[entry["name"]])
            continue
        try:
            weight = dequantize(raw.reshape(int(np.prod(shape[:-1])), -1), GGMLQuantizationType[entry["type"]])
        except Exception as e:
            raise ValueError(f"cannot read tensor {entry['gguf_name']} of GGUF file {path} ({e}): the file is "
                             f"corrupt") from e
        # F32 tensors come back as read-only views of the mapped file.
        weight = np.require(weight, np.float32, ["C", "W"]).reshape(shape)
        if entry["permute_heads"]:
            weight = _unpermute(weight, entry["permute_heads"])
        if entry.get("subtract"):
            weight = weight - np.float32(entry["subtract"])
        yield entry["name"], torch.from_numpy(np.ascontiguousarray(weight))


def _read_part(path: str, data: np.ndarray, part: dict[str, Any]) -> np.ndarray:
    """One tensor's bytes, as (rows, bytes a row)."""
    raw = data[part["offset"]:part["offset"] + part["nbytes"]]
    if len(raw) != part["nbytes"]:
        raise ValueError(f"GGUF file {path} ends inside tensor {part['gguf_name']}: the file is truncated; "
                         f"download or convert it again")
    return raw.reshape(int(np.prod(part["shape"][:-1])), -1)


def _dequantized_part(path: str, data: np.ndarray, part: dict[str, Any]) -> np.ndarray:
    from gguf import GGMLQuantizationType, dequantize

    raw = _read_part(path, data, part)
    try:
        weight = dequantize(raw, GGMLQuantizationType[part["type"]])
    except Exception as e:
        raise ValueError(f"cannot read tensor {part['gguf_name']} of GGUF file {path} ({e}): the file is "
                         f"corrupt") from e
    return np.asarray(weight, dtype=np.float32).reshape(part["shape"])


def _gate_and_up(arrays: list[np.ndarray], axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) from [gate, up], or from one fused [gate; up] split in halves along `axis`."""
    if len(arrays) == 2:
        return arrays[0], arrays[1]
    gate, up = np.split(arrays[0], 2, axis=axis)
    return gate, up


def _interleaved(gate: np.ndarray, up: np.ndarray, axis: int) -> np.ndarray:
    """transformers' gate_up layout: gate j at 2j, up j at 2j + 1 along `axis`."""
    stacked = np.stack((gate, up), axis=axis + 1)
    return stacked.reshape(*gate.shape[:axis], 2 * gate.shape[axis], *gate.shape[axis + 1:])


MXFP4_BLOCK_BYTES = 17
"""ggml's block_mxfp4: one e8m0 scale byte, then 16 bytes of 32 e2m1 codes."""


def mxfp4_blocks_as_hf(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 rows (rows, G * 17) -> transformers' (rows, G, 16) codes and (rows, G) scales.

    The codes and scales are the same numbers in both (e2m1 codes 0-15 in the same order, the e8m0
    scale byte); only the nibble order differs: ggml's byte j holds element j (low nibble) and
    element j + 16 (high), transformers' byte i elements 2i (low) and 2i + 1 (high)."""
    blocks = raw.reshape(raw.shape[0], -1, MXFP4_BLOCK_BYTES)
    scales = np.ascontiguousarray(blocks[..., 0])
    packed = blocks[..., 1:]
    codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1)  # element order 0..31
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)), scales


def _mxfp4_part(path: str, data: np.ndarray, part: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """One MXFP4 expert tensor (E, rows, cols) as transformers' blocks (E, rows, cols / 32, 16) and
    scales (E, rows, cols / 32), checked on its first rows against gguf's own dequantization."""
    from gguf import GGMLQuantizationType, dequantize

    from kvtide.layers.quantization.mxfp4 import dequantize_mxfp4

    raw = _read_part(path, data, part)
    blocks, scales = mxfp4_blocks_as_hf(raw)
    check = min(len(raw), SELF_CHECK_ROWS)
    ours = dequantize_mxfp4(torch.from_numpy(blocks[:check]), torch.from_numpy(scales[:check])).numpy()
    if not np.array_equal(ours, dequantize(raw[:check], GGMLQuantizationType.MXFP4)):
        raise ValueError(f"GGUF file {path}: MXFP4 tensor {part['gguf_name']} does not decode to gguf's values "
                         f"in transformers' layout")
    experts, rows, cols = part["shape"]
    return blocks.reshape(experts, rows, cols // 32, 16), scales.reshape(experts, rows, cols // 32)


def gpt_oss_expert_tensors(path: str, data: np.ndarray, entry: dict[str, Any]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """One gpt-oss expert entry in transformers' layout: gate_up_proj (E, H, 2I) with gate and up
    interleaved along its last dim, down_proj (E, I, H), their biases (E, 2I) and (E, H). llama.cpp
    stores each projection as (E, out, in) rows, gate and up apart. An all-MXFP4 weight comes as
    `<name>_blocks` and `<name>_scales` (transformers' MXFP4 checkpoint layout, (E, out, in / 32, 16)
    and (E, out, in / 32), gate_up rows interleaved), which the model holds as they are or decodes."""
    name, layout, parts = entry["name"], entry["expert_layout"], entry["parts"]
    if not name.endswith("_bias") and all(part["type"] == "MXFP4" for part in parts):
        blocks, scales = zip(*(_mxfp4_part(path, data, part) for part in parts), strict=True)
        if layout == "gate_up":
            blocks = [_interleaved(*_gate_and_up(list(blocks), 1), axis=1)]
            scales = [_interleaved(*_gate_and_up(list(scales), 1), axis=1)]
        yield f"{name}_blocks", torch.from_numpy(np.ascontiguousarray(blocks[0]))
        yield f"{name}_scales", torch.from_numpy(np.ascontiguousarray(scales[0]))
        return
    arrays = [_dequantized_part(path, data, part) for part in parts]
    if name.endswith("_bias"):  # (E, out)
        out = _interleaved(*_gate_and_up(arrays, 1), axis=1) if layout == "gate_up" else arrays[0]
    else:  # (E, out, in) -> (E, in, out)
        weight = _interleaved(*_gate_and_up(arrays, 1), axis=1) if layout == "gate_up" else arrays[0]
        out = weight.transpose(0, 2, 1)
    yield name, torch.from_numpy(np.array(out, dtype=np.float32, order="C"))  # a copy: F32 reads are views


SELF_CHECK_ROWS = 64
"""Rows of each kept-quantized tensor checked against gguf's own dequantization at load: a wrong
block decode shows in any row, and the whole tensor would cost as much as dequantizing it."""


def _kept_quantized(path: str, entry: dict[str, Any], raw: np.ndarray, layout: tuple[str, int, bool]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """One GGUF tensor as codes/scales/mins in its layer's layout (see layers/quantization/gguf.py)."""
    from gguf import GGMLQuantizationType, dequantize

    from kvtide.layers.quantization.gguf_codecs import check_decoded, decode_blocks
    from kvtide.layers.quantization.qweight import NIBBLE_KINDS, QuantizedWeight, pack_int4, promote

    kind, group, has_mins = layout
    rows, k = int(np.prod(entry["shape"][:-1])), entry["shape"][-1]
    blocks = raw.reshape(rows, -1)
    try:
        decoded = decode_blocks(blocks, entry["type"], k)
        check = min(rows, SELF_CHECK_ROWS)
        check_decoded(decoded if check == rows else _first_rows(decoded, check),
                      dequantize(blocks[:check], GGMLQuantizationType[entry["type"]]), entry["gguf_name"])
    except ValueError as e:
        raise ValueError(f"GGUF file {path}: {e}") from e
    codes, scales, mins = decoded.codes, decoded.scales, decoded.mins
    if entry["permute_heads"]:
        codes, scales = _unpermute(codes, entry["permute_heads"]), _unpermute(scales, entry["permute_heads"])
        mins = None if mins is None else _unpermute(mins, entry["permute_heads"])
    codes_t = torch.from_numpy(np.ascontiguousarray(codes))
    qw = QuantizedWeight(decoded.kind, pack_int4(codes_t) if decoded.kind in NIBBLE_KINDS else codes_t,
                         torch.from_numpy(np.ascontiguousarray(scales)),
                         None if mins is None else torch.from_numpy(np.ascontiguousarray(mins)),
                         decoded.group_size, rows, k)
    if (qw.kind, qw.group_size) != (kind, group):
        qw = promote(qw, kind, group)
    module = entry["name"].removesuffix(".weight")
    yield f"{module}.gguf_codes", qw.codes
    yield f"{module}.gguf_scales", qw.scales
    if has_mins:
        yield f"{module}.gguf_mins", qw.mins if qw.mins is not None else torch.zeros_like(qw.scales)


def _first_rows(decoded, rows: int):
    from kvtide.layers.quantization.gguf_codecs import DecodedBlocks

    return DecodedBlocks(decoded.kind, decoded.codes[:rows], decoded.scales[:rows],
                         None if decoded.mins is None else decoded.mins[:rows], decoded.group_size)


def _cache_key(path: str) -> str:
    stat = os.stat(path)
    ident = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{FORMAT_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def prepare_gguf_model_dir(path: str, tokenizer_override: bool = False) -> str:
    """The cached model directory for a GGUF file (built on first use; rebuilt when the file changes).

    With `tokenizer_override` (--tokenizer given) a GGUF whose tokenizer cannot be converted still loads."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} does not exist")
    stem = os.path.splitext(os.path.basename(path))[0]
    target = cache_dir("gguf", f"{stem}-{_cache_key(path)}", create=False)  # checked before it is read
    if os.path.exists(os.path.join(target, MARKER)):
        if not tokenizer_override and not _read_marker(target).get("tokenizer", True):
            raise ValueError(f"GGUF file {path} has no tokenizer kvtide can read; pass --tokenizer DIR")
        return target
    reader = open_gguf(path)
    index = tensor_index(reader, path)  # architecture and tensor types first: the clearest errors
    config = hf_config_dict(reader, path)

    def build(tmp: str) -> None:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(generation, f, indent=2)
        try:
            _write_tokenizer(path, tmp, by_architecture=config["model_type"] != "gpt_oss")
            has_tokenizer = True
        except ValueError:
            if not tokenizer_override:
                raise
            has_tokenizer = False
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"gguf_file": path, "format_version": FORMAT_VERSION, "tokenizer": has_tokenizer,
                       "tensors": index}, f)

    return build_cached_dir(target, build)


def _write_tokenizer(gguf_path: str, out_dir: str, by_architecture: bool = True) -> None:
    """Vocabulary, merges, special tokens and chat template, through transformers' GGUF tokenizer
    conversion (the same one `from_pretrained(gguf_file=...)` uses). Without `by_architecture` the
    generic fast tokenizer class reads the file directly, skipping AutoTokenizer's read of the model
    config from the GGUF (transformers fails on a gpt-oss file's rope.scaling keys there)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loader = AutoTokenizer if by_architecture else PreTrainedTokenizerFast
    try:
        tokenizer = loader.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot read the tokenizer of GGUF file {gguf_path} ({reason}); pass --tokenizer "
                         f"DIR with the model's Hugging Face tokenizer") from e
    tokenizer.save_pretrained(out_dir)


def prepared_weights(model_dir: str, kept: dict[str, tuple[str, int, bool]] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The weights of a prepared GGUF directory, streamed from its file (`kept`: the tensors kept
    quantized, see iterate_gguf_weights); None for an ordinary checkpoint."""
    if not os.path.exists(os.path.join(model_dir, MARKER)):
        return None
    marker = _read_marker(model_dir)
    return iterate_gguf_weights(marker["gguf_file"], marker["tensors"], kept)


def gguf_tensor_types(model_dir: str) -> dict[str, str]:
    """transformers tensor name -> GGUF tensor type, for a prepared GGUF directory ({} otherwise)."""
    if not os.path.exists(os.path.join(model_dir, MARKER)):
        return {}
    return {entry["name"]: entry["type"] for entry in _read_marker(model_dir)["tensors"]}


def gguf_quantized_tensor_types(model_dir: str) -> set[str]:
    """The quantized (not F32/F16/BF16) tensor types of a prepared GGUF directory's linears and
    embeddings (norms are always float); empty for a float GGUF or an ordinary checkpoint."""
    return {t for name, t in gguf_tensor_types(model_dir).items() if t not in ("F32", "F16", "BF16")}


def _read_marker(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, MARKER)) as f:
        return json.load(f)


def export_hf_checkpoint(gguf_path: str, out_dir: str) -> str:
    """Write a GGUF's model as a plain float32 Hugging Face checkpoint (config, tokenizer, safetensors),
    for engines that read only those (transformers without gguf, vLLM). Cached: an existing complete
    export is kept."""
    from safetensors.torch import save_file

    done = os.path.join(private_cache_path(out_dir, create=False), "model.safetensors")  # in the cache: checked
    if os.path.exists(done):
        return out_dir
    prepared = prepare_gguf_model_dir(gguf_path)
    with open(os.path.join(prepared, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)

    def build(tmp: str) -> None:
        shutil.copytree(prepared, tmp, ignore=shutil.ignore_patterns(MARKER), dirs_exist_ok=True)
        weights = {name: tensor for name, tensor in prepared_weights(prepared)
                   if not (tied and name == "lm_head.weight")}
        for name in [n for n in weights if n.endswith("_blocks")]:  # MXFP4 experts, decoded to float
            from kvtide.layers.quantization.mxfp4 import dequantize_expert_weight

            base = name.removesuffix("_blocks")
            weights[base] = dequantize_expert_weight(weights.pop(name), weights.pop(base + "_scales"), torch.float32)
        save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})

    return build_cached_dir(out_dir, build)
