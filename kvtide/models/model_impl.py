"""--model-impl: which implementation runs a checkpoint, kvtide's own module or the transformers
fallback, and the engine options the fallback refuses. Decided from the config alone, before
anything loads, so a bad combination is a ValueError up front."""

from __future__ import annotations

from kvtide.models.registry import (
    MODEL_IMPL_CHOICES,
    NATIVE_IMPL,
    TRANSFORMERS_IMPL,
    architecture_name,
    is_native,
    resolve_architecture,
    supported_architectures,
    unsupported_architecture_message,
)


def resolve_model_impl(hf_config, model_impl: str, trust_remote_code: bool) -> str:
    """NATIVE_IMPL or TRANSFORMERS_IMPL. auto: kvtide's module when it has one for the
    architecture, else the fallback when transformers' class can run with kvtide's attention;
    kvtide (or vllm): the native module or a ValueError; transformers: the fallback or a ValueError."""
    if model_impl not in MODEL_IMPL_CHOICES:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPL_CHOICES)}; got {model_impl!r}")
    if model_impl in ("kvtide", "vllm"):
        resolve_architecture(hf_config)
        return NATIVE_IMPL
    if model_impl == "auto" and is_native(hf_config):
        return NATIVE_IMPL
    from kvtide.models.transformers_fallback import transformers_unsupported_reason

    why = transformers_unsupported_reason(hf_config, trust_remote_code)
    if why is None:
        return TRANSFORMERS_IMPL
    arch = architecture_name(hf_config)
    if model_impl == TRANSFORMERS_IMPL:
        native = (f"; kvtide runs {arch} natively: drop --model-impl transformers" if is_native(hf_config)
                  else f"; kvtide's native architectures: {', '.join(supported_architectures())}")
        raise ValueError(f"--model-impl transformers cannot run {arch}: {why}{native}")
    raise ValueError(unsupported_architecture_message(getattr(hf_config, "architectures", None),
                                                      f"kvtide has no native module for it, and {why}"))


def check_transformers_fallback_options(args, hf_config) -> None:
    """EngineArgs the transformers fallback does not implement, refused by name: it runs HF's
    modules whole, on one rank, with float weights, and drafts nothing."""
    arch = architecture_name(hf_config)
    refused = {
        "--tensor-parallel-size > 1": args.tensor_parallel_size != 1,
        "--pipeline-parallel-size > 1": args.pipeline_parallel_size != 1,
        "--enable-expert-parallel": args.enable_expert_parallel,
        "--speculative-config": args.speculative_config is not None,
        "--quantization": args.quantization is not None,
        "--moe-capacity-factor": args.moe_capacity_factor is not None,
    }
    named = [flag for flag, used in refused.items() if used]
    if named:
        raise ValueError(f"{arch} runs through the transformers fallback (--model-impl transformers), which does "
                         f"not support {', '.join(named)}: it runs Hugging Face's modules whole on one rank, with "
                         f"float weights and no draft model")
