"""Write GGUF files the way llama.cpp's converter does, with the `gguf` package's writer: from a tiny
seeded HF checkpoint directory (config, tokenizer.json, safetensors) to a .gguf of chosen tensor types.

Kept independent of kvtide's reader: the q/k permutation here is llama.cpp's forward one, so a test that
gets the original weights back checks kvtide's inverse.
"""

from __future__ import annotations

import json
import os

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType
from gguf.quants import quantize
from gguf_reference_quants import REFERENCE_QUANTIZERS
from safetensors.numpy import load_file

_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # Phi-3's fused ones
_GEMMA_LAYER = dict(_LAYER, post_attention_layernorm="post_attention_norm", pre_feedforward_layernorm="ffn_norm",
                    post_feedforward_layernorm="post_ffw_norm")
"""Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP."""
GEMMA_ARCHS = ("gemma2", "gemma3")
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    rest = hf_name.removeprefix("model.layers.")
    layer, _, module = rest.partition(".")
    module, _, kind = module.rpartition(".")
    return f"blk.{layer}.{(_GEMMA_LAYER if arch in GEMMA_ARCHS else _LAYER)[module]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama_cpp_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for llama3 rope: one divisor per
    frequency, written as the F32 tensor rope_freqs.weight."""
    import math

    base = rope.get("rope_theta", 10000.0)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def random_k_quant(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of a K-quant type (gguf-py can dequantize these but not quantize them): random
    quants around zero, of about a trained model's size (std ~0.2, as the seeded checkpoints).

    Q4_K/Q5_K: every scale byte 0x11 decodes (6-bit packed scales and mins) to scale == min, 17 in
    four sub-blocks and 1 in the other four; dmin = d x (mid-quant) then centres the quants:
    w = d * scale * (q - mid). Q6_K: w = d * 8 * (q - 32), its int8 scales all 8."""
    from gguf.constants import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)

    def f16(x: float) -> np.ndarray:
        return np.frombuffer(np.float16(x).tobytes(), dtype=np.uint8)

    if qtype in ("Q4_K", "Q5_K"):
        mid, d = (7.5, 0.0026) if qtype == "Q4_K" else (15.5, 0.0013)
        blocks[..., 0:2] = f16(d)
        blocks[..., 2:4] = f16(d * mid)
        blocks[..., 4:16] = 0x11
    else:  # Q6_K: ql[128], qh[64], scales[16], d
        blocks[..., 192:208] = 8
        blocks[..., 208:210] = f16(0.00135)
    return blocks.reshape(rows, -1)


def write_gguf(checkpoint_dir: str, out_path: str, tensor_types: dict[str, str] | str = "F32",
               architecture: str | None = None, name: str = "tiny", seed: int = 0,
               chat_template: str | None = None) -> str:
    """tensor_types: one type for every 2-D weight, or {substring of the GGUF name: type} with a
    "default" key (norms and other 1-D tensors stay F32, as llama.cpp keeps them)."""
    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        config = json.load(f)
    arch = architecture or _ARCH[config["architectures"][0]]
    types = {"default": tensor_types} if isinstance(tensor_types, str) else dict(tensor_types)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(out_path, arch)
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if arch == "phi3":  # convert_hf_to_gguf.py's Phi3MiniModel: no key length, the rotated dims
        _add_phi3_rope(writer, config, rope, head_dim)
    elif arch in GEMMA_ARCHS:
        _add_gemma_keys(writer, arch, config, head_dim)
    else:
        writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch not in GEMMA_ARCHS:
        writer.add_rope_freq_base(float(config.get("rope_theta") or
                                        (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if arch in GEMMA_ARCHS:
        _add_sentencepiece_tokenizer(writer, checkpoint_dir, chat_template)
    else:
        _add_tokenizer(writer, checkpoint_dir, chat_template)

    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(rope, head_dim))
    weights = load_file(os.path.join(checkpoint_dir, "model.safetensors"))
    for hf_name in sorted(weights):
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        weight = weights[hf_name].astype(np.float32)
        name_ = gguf_name(hf_name, arch)
        if arch in GEMMA_ARCHS and name_.endswith("norm.weight"):  # llama.cpp's RMSNorm scales by w, not 1 + w
            weight = weight + 1
        if arch == "llama" and name_.endswith("attn_q.weight"):
            weight = llama_cpp_permute(weight, n_head)
        elif arch == "llama" and name_.endswith("attn_k.weight"):
            weight = llama_cpp_permute(weight, n_kv)
        qtype = "F32" if weight.ndim == 1 else next(
            (t for key, t in types.items() if key != "default" and key in name_), types["default"])
        _add_tensor(writer, name_, weight, qtype, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_gemma_keys(writer: GGUFWriter, arch: str, config: dict, head_dim: int) -> None:
    """The keys convert_hf_to_gguf.py's Gemma2Model / Gemma3Model write. What they leave out llama.cpp
    fixes by convention (query scale 1/sqrt(head_dim) below 27B; sliding layers every other one
    (Gemma 2), five of every six with rope base 10000 (Gemma 3)), so a checkpoint that departs from
    it cannot be written: refused here rather than written wrong."""
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_sliding_window(config["sliding_window"])
    pattern = 2 if arch == "gemma2" else 6
    n = config["num_hidden_layers"]
    expected = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    assert config["layer_types"] == expected, (config["layer_types"], expected)
    assert config["query_pre_attn_scalar"] == head_dim
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        return
    assert config.get("attn_logit_softcapping") is None
    if config.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    full, sliding = config["rope_parameters"]["full_attention"], config["rope_parameters"]["sliding_attention"]
    assert sliding == {"rope_type": "default", "rope_theta": 10000.0}, sliding
    writer.add_rope_freq_base(float(full["rope_theta"]))
    if full.get("rope_type", "default") != "default":
        assert full["rope_type"] == "linear", full
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))


def _add_phi3_rope(writer: GGUFWriter, config: dict, rope: dict, head_dim: int) -> None:
    """Phi-3's rope keys as llama.cpp's converter writes them; LongRoPE's factors as two F32 tensors."""
    import math

    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor") or 1.0)
    writer.add_rope_dimension_count(int(partial * config["hidden_size"]) // config["num_attention_heads"])
    original = config.get("original_max_position_embeddings") or config["max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("rope_type") != "longrope":
        return
    scale = config["max_position_embeddings"] / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _add_tensor(writer: GGUFWriter, name: str, weight: np.ndarray, qtype: str, rng) -> None:
    if qtype == "F32":
        writer.add_tensor(name, weight)
    elif qtype == "F16":
        writer.add_tensor(name, weight.astype(np.float16))
    elif qtype in K_QUANTS:
        data = random_k_quant(weight.shape[0], weight.shape[1], qtype, rng)
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[qtype])
    elif qtype in REFERENCE_QUANTIZERS:  # Q2_K, Q3_K, IQ4_NL, IQ4_XS: the weights, quantized here
        data, _ = REFERENCE_QUANTIZERS[qtype](weight)
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[qtype])
    else:  # BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: gguf-py's own quantizers
        t = GGMLQuantizationType[qtype]
        writer.add_tensor(name, quantize(weight, t), raw_dtype=t)


def _add_tokenizer(writer: GGUFWriter, checkpoint_dir: str, chat_template: str | None) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp stores it: model 'gpt2', tokens by id, merges."""
    with open(os.path.join(checkpoint_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(checkpoint_dir, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)  # llama.cpp writes the list even when it is empty

    def token_id(key: str) -> int | None:
        value = tok_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return vocab.get(value) if value is not None else None

    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if token_id(key) is not None:
            add(token_id(key))
    post = json.dumps(tok.get("post_processor") or {})
    writer.add_add_bos_token(token_id("bos_token") is not None and '"SpecialToken"' in post)
    template = chat_template or tok_config.get("chat_template")
    if template is None and os.path.exists(os.path.join(checkpoint_dir, "chat_template.jinja")):
        with open(os.path.join(checkpoint_dir, "chat_template.jinja")) as f:
            template = f.read()
    if template:
        writer.add_chat_template(template)


def _add_sentencepiece_tokenizer(writer: GGUFWriter, checkpoint_dir: str, chat_template: str | None) -> None:
    """A Gemma tokenizer as llama.cpp stores it: model 'llama', tokens by id with scores and types
    (control, unknown, byte), no merges."""
    with open(os.path.join(checkpoint_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(checkpoint_dir, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token

    def token_type(token: str) -> TokenType:
        if token == "<unk>":
            return TokenType.UNKNOWN
        if token in special:
            return TokenType.CONTROL
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return TokenType.BYTE
        return TokenType.NORMAL

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types([token_type(t) for t in tokens])
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id), ("unk_token", writer.add_unk_token_id)):
        if tok_config.get(key) in vocab:
            add(vocab[tok_config[key]])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    if chat_template or tok_config.get("chat_template"):
        writer.add_chat_template(chat_template or tok_config["chat_template"])


def build_gemma_checkpoint(path: str, architecture: str, seed: int = 0, **config) -> str:
    """A seeded random Gemma checkpoint with a Gemma-style tokenizer: BPE over text whose spaces are
    '▁', byte fallback to the 256 <0xXX> tokens, <pad> <eos> <bos> <unk> <mask> first (Gemma's ids
    0-4), trained on the mixed text."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import GemmaTokenizer

    from kvtide.models.demo import CHAT_TEMPLATE, make_random_checkpoint

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    trainer_tok.train_from_iterator(MIXED_TEXT * 20, trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {token: i for i, token in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" ")) for m in trained["merges"]]
    hf_tok = GemmaTokenizer(vocab=vocab, merges=merges, chat_template=CHAT_TEMPLATE)
    make_random_checkpoint(path, architecture, seed=seed, vocab_size=len(vocab), bos_token_id=vocab["<bos>"],
                           eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"], **config)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    hf_tok.save_pretrained(path)
    return path


MIXED_TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))",
    "机器学习是人工智能的一个分支。我们在这里测试中文分词。你好，世界！",
    "日本語のテキストも少し。こんにちは、世界。",
    "Emoji 🙂🚀🔥 and accents: café, naïve, Zürich, São Paulo.",
    "{\"name\": \"kvtide\", \"tokens\": [1, 2, 3], \"ok\": true}",
]


def build_bpe_checkpoint(path: str, architecture: str = "LlamaForCausalLM", vocab_size: int = 400,
                         seed: int = 0, **config) -> str:
    """A seeded random checkpoint whose tokenizer is a byte-level BPE with real merges, trained on
    mixed text (English, code, CJK, emoji), with BOS prepended and the demo chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from kvtide.models.demo import CHAT_TEMPLATE, make_random_checkpoint

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(MIXED_TEXT * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                     chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    make_random_checkpoint(path, architecture, seed=seed, vocab_size=len(hf_tok), **config)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    hf_tok.save_pretrained(path)
    return path
