"""Architecture name (config.architectures[0]) -> model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("kvtide.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kvtide.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("kvtide.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("kvtide.models.qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("kvtide.models.phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("kvtide.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("kvtide.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("kvtide.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("kvtide.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("kvtide.models.deepseek", "DeepseekV3ForCausalLM"),
    "Gemma2ForCausalLM": ("kvtide.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("kvtide.models.gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("kvtide.models.gemma", "Gemma3ForConditionalGeneration"),
}
TEXT_TOWERS = frozenset({"Gemma3ForConditionalGeneration"})
"""Multimodal architectures served as their text model: the engine reads their text_config."""


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config) -> str:
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in _MODELS:
            return arch
    raise ValueError(f"architecture {architectures or '(none in config.json)'} is not supported; "
                     f"supported: {', '.join(supported_architectures())}; serve a checkpoint of one of these")


def get_model_class(hf_config) -> type:
    module, name = _MODELS[resolve_architecture(hf_config)]
    return getattr(importlib.import_module(module), name)


def served_config(hf_config):
    """The config the engine sizes and builds the model from: `hf_config` itself, or for a
    multimodal checkpoint (TEXT_TOWERS) its text_config, tagged with the checkpoint's architecture
    and carrying the options the outer config holds for it (tied embeddings, dtype)."""
    arch = resolve_architecture(hf_config)
    if arch not in TEXT_TOWERS:
        return hf_config
    text = hf_config.text_config
    text.architectures = [arch]
    for name in ("tie_word_embeddings", "dtype"):
        value = getattr(hf_config, name, None)
        if value is not None:
            setattr(text, name, value)
    return text
