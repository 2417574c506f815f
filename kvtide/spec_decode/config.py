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

    @property
    def uses_model(self) -> bool:
        return self.method in METHODS_WITH_MODEL


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


def resolve_speculative_config(value: str | dict | None, target_hf_config, model_dir: str, max_model_len: int,
                               device: str = "cpu", trust_remote_code: bool = False, tokenizer: str | None = None
                               ) -> SpeculativeConfig | None:
    """Parse, find the draft/head checkpoint, and check it fits the target; ValueError otherwise."""
    import dataclasses

    spec = parse_speculative_config(value)
    if spec is None:
        return None
    if spec.disable_by_batch_size is None:
        spec = dataclasses.replace(spec, disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE[device])
    num_target_layers = target_hf_config.num_hidden_layers
    if spec.method == "layer_skip":
        if spec.num_layers >= num_target_layers:
            raise ValueError(f"speculative_config: layer_skip num_layers ({spec.num_layers}) must be below the "
                             f"target's {num_target_layers} layers")
        cost = spec.num_layers / num_target_layers
        return dataclasses.replace(spec, draft_cost=spec.draft_cost if spec.draft_cost is not None else cost)
    if spec.method == "ngram":
        return dataclasses.replace(spec, draft_cost=spec.draft_cost or 0.0)
    from kvtide.engine_args import EngineArgs

    draft_dir = EngineArgs(model=spec.model).resolve_model_dir()
    if spec.method != "draft_model":
        return _resolve_head(spec, draft_dir, target_hf_config)
    from transformers import AutoConfig

    from kvtide.models.registry import resolve_architecture

    try:
        draft_config = AutoConfig.from_pretrained(draft_dir, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ValueError(f"speculative_config: cannot read the draft model's config in {draft_dir}: {e}") from e
    resolve_architecture(draft_config)
    if draft_config.vocab_size != target_hf_config.vocab_size:
        raise ValueError(f"speculative_config: the draft's vocabulary ({draft_config.vocab_size} tokens) differs "
                         f"from the target's ({target_hf_config.vocab_size}); a draft must share the tokenizer")
    if not _same_tokenizer(tokenizer or model_dir, draft_dir):
        raise ValueError(f"speculative_config: the draft model's tokenizer ({draft_dir}) differs from the target's; "
                         f"a draft must share the target's tokenizer")
    limit = getattr(draft_config, "max_position_embeddings", None) or max_model_len
    if limit < max_model_len:
        raise ValueError(f"speculative_config: the draft model holds {limit} positions, below max_model_len "
                         f"({max_model_len}); lower --max-model-len")
    cost = spec.draft_cost if spec.draft_cost is not None else \
        min(_approx_params(draft_config) / _approx_params(target_hf_config), 0.99)
    return dataclasses.replace(spec, model=draft_dir, draft_hf_config=draft_config, draft_cost=cost)


def _resolve_head(spec: SpeculativeConfig, head_dir: str, target_hf_config) -> SpeculativeConfig:
    import dataclasses

    from kvtide.spec_decode.heads.loading import detect_head_method

    found = detect_head_method(head_dir)
    if found is None:
        raise ValueError(f"speculative_config: {head_dir} is not a Medusa or EAGLE head checkpoint")
    if found != spec.method:
        raise ValueError(f"speculative_config: method {spec.method!r} but {head_dir} holds a {found!r} head")
    with open(f"{head_dir}/config.json") as f:
        head_config = json.load(f)
    hidden = head_config.get("hidden_size", target_hf_config.hidden_size)
    if hidden != target_hf_config.hidden_size:
        raise ValueError(f"speculative_config: the head's hidden size ({hidden}) differs from the target's "
                         f"({target_hf_config.hidden_size})")
    return dataclasses.replace(spec, model=head_dir, draft_cost=spec.draft_cost or 0.0)


def _approx_params(hf_config) -> float:
    """Weights read per decode step (layers and LM head), for the draft's relative cost."""
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    inter = getattr(hf_config, "intermediate_size", 4 * h)
    return layers * (4 * h * h + 3 * h * inter) + h * hf_config.vocab_size


def _same_tokenizer(target_dir: str, draft_dir: str) -> bool:
    """Whether two checkpoints' tokenizer.json vocabularies agree (True when either has none: the
    vocabulary sizes were compared already)."""
    import os

    paths = [os.path.join(d, "tokenizer.json") for d in (target_dir, draft_dir)]
    if not all(os.path.exists(p) for p in paths):
        return True
    vocabs = []
    for path in paths:
        with open(path) as f:
            vocabs.append(json.load(f).get("model", {}).get("vocab"))
    return vocabs[0] == vocabs[1]
