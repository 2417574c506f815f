"""PoolerConfig: how a pooling model turns hidden states into its output, and how the engine runs it.

Resolved once from the checkpoint and the flags (`--runner`, `--convert`, `--pooler-config`):

    runner auto:  pooling when the architecture is one (an embedding `*Model`, `*ForSequenceClassification`,
                  an encoder), else generation
    convert:      a causal LM checkpoint served as an embedder (`XForCausalLM` -> `XModel`, its LM head
                  left unread) or a classifier (`XForSequenceClassification`, which needs a `score` head)
    defaults:     decoder embedders LAST + normalize; classifiers LAST, softmax; encoders CLS + normalize;
                  sentence-transformers' modules.json / 1_Pooling/config.json override them; the
                  --pooler-config JSON overrides everything.

Causal models run chunked prefill (the pooled state is carried across chunks) and, with LAST pooling,
the prefix cache (only the last position's hidden state is read). Encoders attend both ways, so a
prompt runs whole in one step and nothing is cached.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")

DECODER_EMBEDDERS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                     "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
"""Embedding architecture -> the causal LM it converts from."""
DECODER_CLASSIFIERS = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                       "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                       "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}
ENCODER_CLASSIFIERS = ("XLMRobertaForSequenceClassification", "RobertaForSequenceClassification",
                       "BertForSequenceClassification")
"""Cross-encoders of the bge-reranker and ms-marco MiniLM kinds (CLS pooling, the encoder's head)."""
ENCODERS = ("BertModel", "XLMRobertaModel", "RobertaModel", *ENCODER_CLASSIFIERS)
POOLING_ARCHITECTURES = frozenset(DECODER_EMBEDDERS) | frozenset(DECODER_CLASSIFIERS) | frozenset(ENCODERS)

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")


@dataclass(frozen=True)
class PoolerConfig:
    task: str
    """The model's kind: "embed" (vectors) or "classify" (a score head over labels)."""
    pooling_type: str = "LAST"
    """LAST (the last prompt token), MEAN (over the prompt) or CLS (the first token)."""
    normalize: bool = True
    """embed: L2-normalize unless a request says otherwise."""
    dimensions: int | None = None
    """embed: the output's default length (Matryoshka cut); None: the hidden size."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """Lengths a request's `dimensions` may take; None: the model declares no Matryoshka support and
    `dimensions` is refused (an empty tuple: any length up to the hidden size)."""
    causal: bool = True
    """False for encoders: bidirectional attention, whole prompts in one step, no prefix cache."""
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)

    @property
    def prefix_caching_ok(self) -> bool:
        """Only LAST pooling of a causal model reads no hidden state a prefix hit would skip."""
        return self.causal and self.pooling_type == "LAST"

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> PoolerConfig:
        """Back from the dict the engine core reports (ModelInfo.pooler; extra keys ignored)."""
        known = {name: fields[name] for name in cls.__dataclass_fields__ if name in fields}
        dims = known.get("matryoshka_dimensions")
        known["matryoshka_dimensions"] = tuple(dims) if dims is not None else None
        known["id2label"] = {int(k): str(v) for k, v in (known.get("id2label") or {}).items()}
        return cls(**known)

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        if dimensions is None:
            return
        if self.matryoshka_dimensions is None:
            raise ValueError("dimensions: this model does not support Matryoshka representations, so its "
                             "embeddings cannot be shortened")
        if not 1 <= dimensions <= hidden_size or (self.matryoshka_dimensions and
                                                  dimensions not in self.matryoshka_dimensions):
            allowed = list(self.matryoshka_dimensions) or f"1..{hidden_size}"
            raise ValueError(f"dimensions: {dimensions} is not one this model supports ({allowed})")


def resolve_pooling(runner: str, convert: str, pooler_config: str | dict | None, hf_config,
                    model_dir: str) -> PoolerConfig | None:
    """The pooler of a pooling model, or None to generate. A converted checkpoint's
    `hf_config.architectures` is rewritten to the pooling architecture the registry builds."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}; got {convert!r}")
    overrides = _parse_overrides(pooler_config)
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = archs[0] if archs else ""
    native = arch in POOLING_ARCHITECTURES
    if runner == "generate" or (runner == "auto" and not native and convert in ("auto", "none")):
        if overrides:
            raise ValueError("--pooler-config applies to pooling models only (--runner pooling)")
        return None
    from_tokens = overrides.pop("classifier_from_token", None) or getattr(hf_config, "classifier_from_token", None)
    if from_tokens:
        _use_token_classifier(hf_config, list(from_tokens), model_dir)
        convert = "classify"
    if convert in ("embed", "classify") or not native:
        arch = _converted(arch, "classify" if convert == "classify" else "embed")
        hf_config.architectures = [arch]
    task = "classify" if arch in DECODER_CLASSIFIERS or arch in ENCODER_CLASSIFIERS else "embed"
    if arch == "BertForSequenceClassification":
        _use_segment_separator(hf_config, model_dir)
    causal = arch not in ENCODERS
    settings: dict[str, Any] = {"pooling_type": "LAST" if causal else "CLS", "normalize": task == "embed"}
    settings.update(_sentence_transformers_settings(model_dir))
    settings.update(overrides)
    matryoshka = _matryoshka_dimensions(hf_config, model_dir)
    num_labels = int(getattr(hf_config, "num_labels", 0) or 0) if task == "classify" else 0
    id2label = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()} \
        if task == "classify" else {}
    config = PoolerConfig(task=task, pooling_type=str(settings["pooling_type"]).upper(),
                          normalize=bool(settings["normalize"]), dimensions=settings.get("dimensions"),
                          matryoshka_dimensions=matryoshka, causal=causal, num_labels=num_labels, id2label=id2label)
    if config.pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}; "
                         f"got {settings['pooling_type']!r}")
    if config.dimensions is not None:
        if config.matryoshka_dimensions is None:  # naming a default length declares the cut allowed
            config = PoolerConfig(**{**config.__dict__, "matryoshka_dimensions": ()})
        config.check_dimensions(config.dimensions, hf_config.hidden_size)
    return config


def _converted(arch: str, task: str) -> str:
    table = DECODER_CLASSIFIERS if task == "classify" else DECODER_EMBEDDERS
    if arch in table or arch in (ENCODER_CLASSIFIERS if task == "classify" else ENCODERS):
        return arch
    for pooling_arch, causal_lm in table.items():
        if arch == causal_lm:
            return pooling_arch
    kinds = sorted(set(table.values()) | set(table))
    raise ValueError(f"cannot run architecture {arch or '(none in config.json)'} as a pooling model "
                     f"(--convert {task}); supported: {', '.join(kinds)}"
                     + ("" if task == "classify" else f", and the encoders {', '.join(ENCODERS)}"))


def _use_segment_separator(hf_config, model_dir: str) -> None:
    """A BERT cross-encoder gives a pair's second text token type 1: it starts after the first
    separator token, which the tokenizer names (models/bert.py token_types)."""
    from transformers import AutoTokenizer

    sep = AutoTokenizer.from_pretrained(model_dir).sep_token_id
    if sep is None and getattr(hf_config, "type_vocab_size", 1) > 1:
        raise ValueError("a BERT cross-encoder needs its tokenizer's sep_token to tell a pair's two texts apart")
    hf_config.segment_separator_id = sep


def _use_token_classifier(hf_config, tokens: list[str], model_dir: str) -> None:
    """The Qwen3-Reranker convention: a causal LM scores a pair by its next-token logits of two
    tokens, `classifier_from_token` = [no, yes]: one label whose logit is logit(yes) - logit(no),
    its `score` row built from the LM head's two rows (models/pooling_decoders.py)."""
    if len(tokens) != 2 or not all(isinstance(t, str) for t in tokens):
        raise ValueError("classifier_from_token must name two tokens: [negative, positive] (e.g. [\"no\", \"yes\"])")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"classifier_from_token: {tokens} are not both single tokens of the vocabulary")
    hf_config.classifier_token_ids = [int(i) for i in ids]
    hf_config.num_labels = 1
    hf_config.id2label = {0: "LABEL_0"}


def _parse_overrides(pooler_config: str | dict | None) -> dict[str, Any]:
    if pooler_config is None or pooler_config == "":
        return {}
    if isinstance(pooler_config, str):
        try:
            pooler_config = json.loads(pooler_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"pooler_config is not valid JSON: {e}") from e
    if not isinstance(pooler_config, dict):
        raise ValueError("pooler_config must be a JSON object")
    known = {"pooling_type", "normalize", "dimensions", "classifier_from_token"}
    unknown = set(pooler_config) - known
    if unknown:
        raise ValueError(f"pooler_config: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    dims = pooler_config.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ValueError(f"pooler_config: dimensions must be a positive integer, got {dims!r}")
    return dict(pooler_config)


_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def _sentence_transformers_settings(model_dir: str) -> dict[str, Any]:
    """Pooling type and normalization from a sentence-transformers layout (modules.json naming a
    Pooling module's directory and whether a Normalize module follows); {} without one."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        modules = json.load(f)
    types = [str(m.get("type", "")) for m in modules]
    settings: dict[str, Any] = {"normalize": any(t.endswith(".Normalize") for t in types)}
    unsupported = [t for t in types if t.rsplit(".", 1)[-1] not in ("Transformer", "Pooling", "Normalize")]
    if unsupported:
        raise ValueError(f"sentence-transformers module(s) {unsupported} in {path} are not supported "
                         f"(only Transformer, Pooling and Normalize)")
    for module in modules:
        if str(module.get("type", "")).endswith(".Pooling"):
            config_path = os.path.join(model_dir, module.get("path", ""), "config.json")
            with open(config_path) as f:
                pooling = json.load(f)
            bad = [k for k in _ST_UNSUPPORTED if pooling.get(k)]
            chosen = [mode for key, mode in _ST_MODES.items() if pooling.get(key)]
            if bad or len(chosen) != 1:
                raise ValueError(f"{config_path}: kvtide pools with exactly one of cls_token, mean_tokens or "
                                 f"lasttoken; this config asks for {bad + chosen or 'none'}")
            settings["pooling_type"] = chosen[0]
    return settings


def _matryoshka_dimensions(hf_config, model_dir: str) -> tuple[int, ...] | None:
    """Declared Matryoshka support: config.json's `matryoshka_dimensions` (a list) or
    `is_matryoshka` (any length)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    if getattr(hf_config, "is_matryoshka", False):
        return ()
    return None


def apply_pooler(config, pooler: PoolerConfig):
    """An EngineConfig adjusted to run `pooler`'s model: an encoder takes whole prompts (no chunked
    prefill, a step budget of at least max_model_len); the prefix cache only where pooling reads no
    hidden state of a cached prefix (LAST pooling of a causal model)."""
    from dataclasses import replace

    if config.speculative_config is not None:
        raise ValueError("speculative decoding does not apply to a pooling model (it generates nothing): drop "
                         "--speculative-config")
    model = replace(config.model_config, pooler_config=pooler)
    hf_config = model.hf_config
    if "Roberta" in (getattr(hf_config, "architectures", None) or [""])[0]:
        # RoBERTa's positions start past the padding id: max_position_embeddings - pad - 1 usable.
        usable = hf_config.max_position_embeddings - int(hf_config.pad_token_id) - 1
        if model.max_model_len > usable:
            model = replace(model, max_model_len=usable)
    cache, sched = config.cache_config, config.scheduler_config
    if not pooler.prefix_caching_ok:
        cache = replace(cache, enable_prefix_caching=False)
    if not pooler.causal:
        sched = replace(sched, enable_chunked_prefill=False,
                        max_num_batched_tokens=max(sched.max_num_batched_tokens, model.max_model_len))
    return replace(config, model_config=model, cache_config=cache, scheduler_config=sched)
