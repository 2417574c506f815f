"""A SpeculativeConfig resolved against the target: the draft or head checkpoint found, checked to
fit (vocabulary, tokenizer, positions, hidden size, method), and the defaults that depend on the
device and the models filled in. Runs at startup, before any model loads."""

from __future__ import annotations

import dataclasses
import json
import os

from kvtide.models.model_dir import resolve_model_dir
from kvtide.spec_decode.config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    SpeculativeConfig,
    parse_speculative_config,
)


def resolve_speculative_config(value: str | dict | None, target_hf_config, model_dir: str, max_model_len: int,
                               device: str = "cpu", trust_remote_code: bool = False, tokenizer: str | None = None
                               ) -> SpeculativeConfig | None:
    """Parse, find the draft/head checkpoint, and check it fits the target; ValueError otherwise."""
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
    draft_dir = resolve_model_dir(spec.model)
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
    paths = [os.path.join(d, "tokenizer.json") for d in (target_dir, draft_dir)]
    if not all(os.path.exists(p) for p in paths):
        return True
    vocabs = []
    for path in paths:
        with open(path) as f:
            vocabs.append(json.load(f).get("model", {}).get("vocab"))
    return vocabs[0] == vocabs[1]
