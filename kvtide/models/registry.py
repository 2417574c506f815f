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
}


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
