"""The KV flags checked together, before anything is built: cache dtype, sink + window attention,
score-based dropping, and the window the scheduler may free blocks against.

    every layer windowed (the model's own windows, or --kv-window-tokens)
        -> CacheConfig.sliding_window = the widest of them: blocks wholly before
           (first query position - window + 1) are never read again by any layer
    any full-attention layer -> None: nothing can be freed from a single block table, so
    full and windowed layers mixed -> CacheConfig.kv_cache_groups: a table per layer kind
                                      (kv_cache/hybrid.py), the windowed ones freeing
"""

from __future__ import annotations

import logging

from kvtide.kv_compression.formats import KV_CACHE_DTYPES, QUANT_KV_DTYPES

logger = logging.getLogger(__name__)

DROP_POLICIES = ("score",)


def layer_windows(hf_config) -> list[int | None]:
    """Each layer's own attention window (None: full attention), as the model classes build them."""
    from kvtide.models.llama import sliding_window_for_layer

    return [sliding_window_for_layer(hf_config, i) for i in range(hf_config.num_hidden_layers)]


def effective_window(model_window: int | None, kv_window_tokens: int | None) -> int | None:
    """A layer's window under --kv-window-tokens: the narrower of its own and the user's."""
    if kv_window_tokens is None:
        return model_window
    return kv_window_tokens if model_window is None else min(model_window, kv_window_tokens)


def resolve_kv_policy(args, hf_config, attention_backend: str) -> dict:
    """EngineArgs (with the resolved attention backend) -> the CacheConfig fields of KV compression;
    a bad combination is a ValueError."""
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {args.kv_cache_dtype!r}")
    if args.calculate_kv_scales and args.kv_cache_dtype not in QUANT_KV_DTYPES:
        raise ValueError("--calculate-kv-scales needs a quantized --kv-cache-dtype (fp8, fp8_e4m3, fp8_e5m2, "
                         f"int8, k8v4); got {args.kv_cache_dtype!r}")
    sinks, window = args.kv_sink_tokens, args.kv_window_tokens
    if sinks < 0:
        raise ValueError(f"kv_sink_tokens must be >= 0, got {sinks}")
    if window is not None and window < 1:
        raise ValueError(f"kv_window_tokens must be >= 1, got {window}")
    if sinks and window is None:
        raise ValueError("--kv-sink-tokens needs --kv-window-tokens (sinks are what a windowed query keeps "
                         "seeing besides its window)")
    policy, budget = args.kv_drop_policy, args.kv_drop_budget
    if policy is not None and policy not in DROP_POLICIES:
        raise ValueError(f"kv_drop_policy must be one of {', '.join(DROP_POLICIES)}; got {policy!r}")
    if policy is None and budget is not None:
        raise ValueError("--kv-drop-budget needs --kv-drop-policy score")
    if policy is not None:
        if budget is None or not 0 < budget <= 1:
            raise ValueError(f"--kv-drop-policy {policy} needs --kv-drop-budget in (0, 1]; got {budget}")
        if args.enable_prefix_caching:
            raise ValueError("--kv-drop-policy score drops blocks by a request's own attention, so its blocks "
                             "cannot be shared through the prefix cache; add --no-enable-prefix-caching")
        if window is not None:
            raise ValueError("--kv-drop-policy and --kv-window-tokens are two ways to bound a request's KV; "
                             "choose one")
        if args.speculative_config is not None:
            raise ValueError("--kv-drop-policy does not combine with speculative decoding yet (a rejected "
                             "draft's attention would count toward the scores); drop one of them")
        if attention_backend == "triton":
            raise ValueError("--kv-drop-policy needs the torch attention paths (--attention-backend cpu, torch "
                             "or torch_ref): the Triton kernel does not skip dropped blocks yet")
    windows = [effective_window(w, window) for w in layer_windows(hf_config)]
    free_window = max(windows) if windows and all(w is not None for w in windows) else None  # type: ignore[type-var]
    return dict(kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                sliding_window=free_window, kv_sink_tokens=sinks if window is not None else 0,
                kv_window_tokens=window, kv_drop_policy=policy, kv_drop_budget=budget)


def resolve_kv_cache_groups(args, hf_config, kv_policy: dict, speculative, kv_transfer):
    """The layer groups of a model mixing full and windowed layers (kv_cache/hybrid.py), or None:
    one table per request. Where a part of the engine moves or reads whole single tables (a KV
    connector, a draft model's own layers, the drop policy's scores), it keeps one table, which is
    as correct and frees nothing; the log says why. Any tensor or pipeline layout takes the groups:
    the scheduler's tables are world size 1's, and each rank binds slot tensors for the layers it
    holds (kv_cache/hybrid.py stage_slots)."""
    from kvtide.kv_cache.hybrid import plan_kv_cache_groups

    if kv_policy["sliding_window"] is not None:  # every layer windowed: one table frees them all
        return None
    windows = [effective_window(w, args.kv_window_tokens) for w in layer_windows(hf_config)]
    groups = plan_kv_cache_groups(windows)
    if groups is None:
        return None
    reasons = {"--disable-hybrid-kv-cache-manager": args.disable_hybrid_kv_cache_manager,
               "a KV connector": kv_transfer is not None,
               "--kv-drop-policy": kv_policy["kv_drop_policy"] is not None,
               "a draft model's layers": speculative is not None and speculative.method != "ngram"}
    why = [name for name, applies in reasons.items() if applies]
    if why:
        logger.info("full and sliding-window layers share one block table per request (%s): blocks outside "
                    "the window are not freed", ", ".join(why))
        return None
    logger.info("KV cache: %d layer groups of %d layers (full and sliding-window layers keep their own "
                "block tables)", len(groups), max(len(g.layers) for g in groups))
    return groups


def apply_attention_window(layers: list, cache_config) -> None:
    """--kv-window-tokens / --kv-sink-tokens onto each attention layer (the model's own windows
    otherwise stay as built)."""
    if cache_config.kv_window_tokens is None:
        return
    for attn in layers:
        attn.sliding_window = effective_window(attn.sliding_window, cache_config.kv_window_tokens)
        attn.sink_tokens = cache_config.kv_sink_tokens
