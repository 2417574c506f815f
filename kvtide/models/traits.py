"""What an architecture brings that engine options must respect: sparse MoE layers, latent (MLA)
attention. Checked from the config alone, before anything loads, so a bad combination is a
ValueError up front."""

from __future__ import annotations

from kvtide.models.registry import architecture_name

MOE_ARCHITECTURES = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                               "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})
MLA_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})


def is_moe(hf_config) -> bool:
    return architecture_name(hf_config) in MOE_ARCHITECTURES


def uses_mla(hf_config) -> bool:
    return architecture_name(hf_config) in MLA_ARCHITECTURES


def check_model_options(args, hf_config) -> None:
    """EngineArgs against the architecture: MoE-only flags on MoE models, and the KV-cache options
    the latent cache does not implement refused by name."""
    factor = args.moe_capacity_factor
    if factor is not None:
        if not is_moe(hf_config):
            raise ValueError(f"--moe-capacity-factor applies to mixture-of-experts models; "
                             f"{architecture_name(hf_config)} has none")
        if not factor > 0:
            raise ValueError(f"moe_capacity_factor must be > 0, got {factor}")
    if not uses_mla(hf_config):
        return
    arch = architecture_name(hf_config)
    if args.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"{arch} keeps a latent (MLA) KV cache, which is stored in a float dtype only; "
                         f"--kv-cache-dtype {args.kv_cache_dtype} is not supported for it (use auto, float32, "
                         f"bfloat16 or float16)")
    if args.kv_window_tokens is not None or args.kv_drop_policy is not None:
        raise ValueError(f"{arch}'s latent (MLA) attention does not implement --kv-window-tokens or "
                         f"--kv-drop-policy")
