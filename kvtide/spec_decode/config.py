"""SpeculativeConfig: which proposer, how many draft tokens, and when speculation stays off.

Given as vLLM's `--speculative-config '{"method": ..., "num_speculative_tokens": K, ...}'` (a JSON
string on the command line, a dict to `LLM(speculative_config=...)`); every bad value is a
ValueError at startup, before a model loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "layer_skip")
METHODS_WITH_MODEL = ("draft_model", "eagle", "eagle3", "medusa")
KNOWN_KEYS = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
              "num_layers", "disable_by_batch_size", "adaptive", "draft_cost"}
DEFAULT_DISABLE_BY_BATCH_SIZE = {"cpu": 4, "cuda": 32}
"""Batches with more decoding requests than this run without speculation. CPU: measured
(scripts/bench_spec_batch.py, docs/benchmarks.md): n-gram speculation on SmolLM2 gains 1.25x at
4 requests and loses 6% at 8. CUDA: not measured here; a GPU decode step stays bandwidth-bound to
far larger batches."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """ngram, draft_model, eagle, eagle3, medusa or layer_skip."""
    num_speculative_tokens: int
    """Most draft tokens verified per request per step (K)."""
    model: str | None = None
    """The draft checkpoint (draft_model) or head checkpoint (eagle, eagle3, medusa); a resolved
    directory once the engine config is built."""
    prompt_lookup_min: int = 1
    """ngram: shortest suffix n-gram matched against earlier tokens."""
    prompt_lookup_max: int = 4
    """ngram: longest suffix n-gram tried first."""
    num_layers: int | None = None
    """layer_skip: the target's first layers the draft runs before its final norm and LM head."""
    disable_by_batch_size: int | None = None
    """Speculate only in steps with at most this many running requests (larger batches are
    compute-bound: verifying K+1 tokens per request costs more than it saves); None: the
    device's default, DEFAULT_DISABLE_BY_BATCH_SIZE."""
    adaptive: bool = True
    """Choose each request's draft length every step from its measured acceptance rate (off: always
    num_speculative_tokens)."""
    draft_cost: float | None = None
    """A draft token's cost as a fraction of a target step, for the adaptive rule (default by method:
    0 for ngram and heads, num_layers / target layers for layer_skip, the parameter ratio for a
    draft model)."""
    draft_hf_config: Any = None
    """The draft checkpoint's transformers config (draft_model, eagle, eagle3)."""


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """A JSON string or dict -> SpeculativeConfig (unresolved model path), or None when not given."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON ({e}): {value!r}") from e
    if isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = set(value) - KNOWN_KEYS
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(KNOWN_KEYS))}")
    method = value.get("method")
    if method is None and value.get("model"):
        method = "draft_model"
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}; got {method!r}")
    k = value.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    model = value.get("model")
    if method in METHODS_WITH_MODEL and not model:
        raise ValueError(f"speculative_config: method {method!r} needs \"model\" (the draft or head checkpoint)")
    if method not in METHODS_WITH_MODEL and model:
        raise ValueError(f"speculative_config: method {method!r} takes no \"model\"")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo, hi = 1, 4
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {n!r}")
    if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
    num_layers = value.get("num_layers")
    if method == "layer_skip":
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"speculative_config: layer_skip needs num_layers, an integer >= 1; got {num_layers!r}")
    elif num_layers is not None:
        raise ValueError("speculative_config: num_layers applies to method 'layer_skip' only")
    disable = value.get("disable_by_batch_size")
    if disable is not None and (not isinstance(disable, int) or isinstance(disable, bool) or disable < 1):
        raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1, got {disable!r}")
    adaptive = value.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"speculative_config: adaptive must be true or false, got {adaptive!r}")
    cost = value.get("draft_cost")
    if cost is not None and (not isinstance(cost, (int, float)) or isinstance(cost, bool) or not 0 <= cost < 1):
        raise ValueError(f"speculative_config: draft_cost must be a number in [0, 1), got {cost!r}")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, model=model, prompt_lookup_min=lo,
                             prompt_lookup_max=hi, num_layers=num_layers, disable_by_batch_size=disable,
                             adaptive=adaptive, draft_cost=None if cost is None else float(cost))

