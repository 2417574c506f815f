"""Tiny random checkpoints built locally with transformers: the `demo` model and the test fixtures.

The tokenizer is byte-level (one token per UTF-8 byte, plus <s>, </s>, <pad>), so any text
round-trips and multi-byte characters split across tokens, which is what detokenizers get wrong.
Nothing here downloads anything.
"""

from __future__ import annotations

import json
import os

import torch

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

DEMO_CONFIG = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=4096)
DEMO_VERSION = "v1"


def build_byte_tokenizer(model_max_length: int = 4096):
    """A PreTrainedTokenizerFast over UTF-8 bytes, with BOS prepended like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort(key=lambda ch: _byte_of(ch))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=model_max_length, chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    missing = [b for b in range(256) if b not in printable]
    return missing[code - 256]


def make_random_checkpoint(path: str, architecture: str = "LlamaForCausalLM", seed: int = 0,
                           initializer_range: float = 0.2, **config_overrides) -> str:
    """Write a seeded random checkpoint of `architecture` with the byte tokenizer to `path`.

    A large initializer_range gives peaked logits, so greedy decoding has no near-ties and
    float32 outputs compare exactly across implementations."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model_cls = getattr(transformers, architecture, None)
    if model_cls is None:
        raise ValueError(f"transformers has no {architecture}")
    config_cls = model_cls.config_class
    settings = dict(DEMO_CONFIG, vocab_size=BYTE_VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                    pad_token_id=PAD_ID, initializer_range=initializer_range, tie_word_embeddings=False,
                    architectures=[architecture])
    settings.update(config_overrides)
    config = config_cls(**settings)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer(settings["max_position_embeddings"]).save_pretrained(path)
    return path


def demo_model_path() -> str:
    """The `demo` checkpoint, built on first use and cached under $KVTIDE_CACHE (~/.cache/kvtide)."""
    from kvtide.models.cache_dir import build_cached_dir, cache_dir

    path = cache_dir(f"demo-{DEMO_VERSION}", create=False)  # checked before it is read
    if not os.path.exists(os.path.join(path, "kvtide_demo.json")):

        def build(tmp: str) -> None:
            make_random_checkpoint(tmp, seed=1234, initializer_range=0.1)
            with open(os.path.join(tmp, "kvtide_demo.json"), "w") as f:
                json.dump({"version": DEMO_VERSION}, f)

        build_cached_dir(path, build)
    return path
