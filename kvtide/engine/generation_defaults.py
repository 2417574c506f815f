"""The model's own sampling defaults (--generation-config auto|vllm|PATH, vLLM's meaning).

`auto` reads the checkpoint's generation_config.json, `vllm` uses none (kvtide's neutral
defaults: temperature 1, no top-p/top-k/min-p, no repetition penalty), a path reads the
generation_config.json in that directory (or that file). A request's fields it leaves unset
(SamplingParams.unset_fields; the server's omitted fields) take these values."""

from __future__ import annotations

import json
import os
from typing import Any

from kvtide.sampling_params import GENERATION_DEFAULT_FIELDS, SamplingParams

MODES = ("auto", "vllm")


def load_generation_defaults(setting: str | None, model_dir: str) -> dict[str, Any]:
    """{field: value} for the fields of GENERATION_DEFAULT_FIELDS the config sets; ValueError for
    a path that holds no readable generation_config.json or a value SamplingParams refuses."""
    setting = setting or "auto"
    if setting == "vllm":
        return {}
    path = model_dir if setting == "auto" else setting
    if os.path.isdir(path):
        path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(path):
        if setting == "auto":
            return {}
        raise ValueError(f"generation_config: {setting!r} is not auto, vllm or a generation_config.json (or its "
                         f"directory)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path} ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object")
    defaults = {name: config[name] for name in GENERATION_DEFAULT_FIELDS if config.get(name) is not None}
    if defaults.get("top_k") == 0:  # transformers' "no top-k"
        defaults["top_k"] = -1
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"generation_config: {path}: {e}") from e
    return defaults


def describe_generation_defaults(defaults: dict[str, Any], setting: str | None) -> str:
    """The startup log's line on the defaults in force."""
    if not defaults:
        source = "--generation-config vllm" if setting == "vllm" else "no generation_config.json values"
        return f"sampling defaults: kvtide's neutral ones ({source})"
    values = ", ".join(f"{name}={value}" for name, value in defaults.items())
    source = "the model's generation_config.json" if (setting or "auto") == "auto" else setting
    return (f"sampling defaults from {source}: {values} (for requests that leave them unset; "
            f"--generation-config vllm uses kvtide's neutral defaults)")
