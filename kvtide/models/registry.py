"""Architecture name (config.architectures[0]) -> model class, imported lazily.

Two implementations can run a checkpoint: kvtide's own module for the architectures below, and the
transformers fallback (models/transformers_fallback.py), which runs Hugging Face's modeling code
with kvtide's paged attention. `--model-impl` picks between them (models/model_impl.py).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re

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
    "GptOssForCausalLM": ("kvtide.models.gpt_oss", "GptOssForCausalLM"),
    # Pooling models (kvtide/pooling/): embedders, sequence classifiers, encoders.
    **{arch: ("kvtide.models.pooling_decoders", arch) for arch in (
        "LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", "LlamaForSequenceClassification",
        "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")},
    **{arch: ("kvtide.models.bert", arch) for arch in ("BertModel", "XLMRobertaModel", "RobertaModel",
                                                        "XLMRobertaForSequenceClassification",
                                                        "BertForSequenceClassification",
                                                        "RobertaForSequenceClassification")},
}
TEXT_TOWERS = frozenset({"Gemma3ForConditionalGeneration"})
"""Multimodal architectures served as their text model: the engine reads their text_config."""
_TRANSFORMERS_FALLBACK = ("kvtide.models.transformers_fallback", "TransformersForCausalLM")

NATIVE_IMPL = "kvtide"
TRANSFORMERS_IMPL = "transformers"
MODEL_IMPL_CHOICES = ("auto", "kvtide", "vllm", "transformers")
"""--model-impl values; "vllm" is a synonym of "kvtide" (kvtide's own modules), for vLLM's flag."""


def describe_model_impl(model_impl: str) -> str:
    """How the startup log and /v1/models name a resolved implementation."""
    if model_impl == TRANSFORMERS_IMPL:
        return "transformers (Hugging Face modeling code, kvtide paged attention)"
    return "kvtide (native)"


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def is_native(hf_config) -> bool:
    """Whether kvtide has a module of its own for one of the config's architectures."""
    return any(arch in _MODELS for arch in getattr(hf_config, "architectures", None) or [])


def architecture_name(hf_config) -> str:
    """The architecture a checkpoint runs as: the first kvtide implements, else the first listed."""
    architectures = getattr(hf_config, "architectures", None) or []
    return next((arch for arch in architectures if arch in _MODELS), architectures[0] if architectures else
                "(none in config.json)")


def unsupported_architecture_message(architectures: list[str] | None, why: str) -> str:
    """The one refusal of an architecture neither implementation runs (the engine's and the
    checkpoint preflight's): it names the architecture, why not, and both ways forward."""
    return (f"architecture {architectures or '(none in config.json)'} is not supported: {why}. Either serve a "
            f"checkpoint of an architecture kvtide implements natively ({', '.join(supported_architectures())}), "
            f"or one whose transformers class routes attention through transformers' attention interface, "
            f"with --model-impl transformers (--model-impl auto picks it when kvtide has no module of its own)")


def no_transformers_class_reason(arch: str) -> str:
    return f"transformers has no causal-LM class named {arch}"


@functools.cache
def transformers_causal_lm_names() -> frozenset[str] | None:
    """The causal-LM class names transformers' auto mapping lists, read from its source text (no
    import: the checkpoint preflight runs before torch loads); None when that file cannot be read."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "models", "auto", "modeling_auto.py")
    try:
        with open(path) as f:
            source = f.read()
    except OSError:
        return None
    block = re.search(r"MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = OrderedDict\((.*?)\n\)", source, re.DOTALL)
    if block is None:
        return None
    return frozenset(re.findall(r'\(\s*"[^"]+",\s*"(\w+)"\s*\)', block.group(1)))


def resolve_architecture(hf_config) -> str:
    """The architecture kvtide's own modules run; ValueError when it has none for the config."""
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in _MODELS:
            return arch
    raise ValueError(unsupported_architecture_message(architectures, "kvtide has no native module for it"))


def get_model_class(hf_config, model_impl: str = NATIVE_IMPL) -> type:
    """The class the loader builds: kvtide's module for the architecture, or the transformers
    fallback (`model_impl` "transformers", as resolved by models/model_impl.py)."""
    if model_impl == TRANSFORMERS_IMPL:
        module, name = _TRANSFORMERS_FALLBACK
    else:
        module, name = _MODELS[resolve_architecture(hf_config)]
    return getattr(importlib.import_module(module), name)


def served_config(hf_config):
    """The config the engine sizes and builds the model from: `hf_config` itself, or for a
    multimodal checkpoint (TEXT_TOWERS) its text_config, tagged with the checkpoint's architecture
    and carrying the options the outer config holds for it (tied embeddings, dtype)."""
    towers = [arch for arch in getattr(hf_config, "architectures", None) or [] if arch in TEXT_TOWERS]
    if not towers:
        return hf_config
    arch = towers[0]
    text = hf_config.text_config
    text.architectures = [arch]
    for name in ("tie_word_embeddings", "dtype"):
        value = getattr(hf_config, name, None)
        if value is not None:
            setattr(text, name, value)
    return text
