"""Checks of a local checkpoint directory that need no torch, no transformers and no weights read.

`kvtide serve` runs them before it starts its engine core: a supported architecture in config.json,
safetensors files as long as their headers say, a tokenizer to load. A broken checkpoint is then
refused in a fraction of a second instead of after two interpreters imported torch and the engine
loaded what it could. Each check refuses only what the engine would refuse too, with the message
the engine gives; anything it cannot judge cheaply (no config.json, remote code, GGUF files, hub
ids) is left to the engine.
"""

from __future__ import annotations

import glob
import json
import os
import struct

from kvtide.models.registry import (
    architecture_name,
    is_native,
    no_transformers_class_reason,
    resolve_architecture,
    transformers_causal_lm_names,
    unsupported_architecture_message,
)

TOKENIZER_FILE_HINTS = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "spiece")
"""Prefixes of the files a tokenizer is built from (transformers' vocabulary files and configs)."""
TOKENIZER_FILE_SUFFIXES = (".model", ".tiktoken")
"""sentencepiece and tiktoken vocabularies, whatever their names."""


def check_checkpoint_dir(model_dir: str, tokenizer_dir: str | None = None, trust_remote_code: bool = False,
                         model_impl: str = "auto") -> None:
    """ValueError (the engine's message) if `model_dir` cannot be served: an architecture neither
    kvtide nor transformers implements (kvtide alone with `model_impl` kvtide or vllm), a truncated
    or corrupt safetensors file, or no tokenizer files in `tokenizer_dir` (default: `model_dir`)."""
    if trust_remote_code:
        return
    config = _read_config(model_dir)
    if config is not None:
        _check_architecture(_Architectures(config.get("architectures")), config, model_impl)
    for path in _safetensors_files(model_dir):
        check_safetensors_header(path)
    tokenizer_dir = tokenizer_dir or model_dir
    if os.path.isdir(tokenizer_dir) and not has_tokenizer_files(tokenizer_dir):
        raise ValueError(f"cannot load a tokenizer from {tokenizer_dir} (no tokenizer files in it); pass "
                         f"--tokenizer DIR, a directory with tokenizer.json or tokenizer_config.json")


def _check_architecture(architectures: _Architectures, config: dict, model_impl: str) -> None:
    """The engine's refusal of an architecture, where the names alone decide it: not native with
    --model-impl kvtide, or (auto) neither native nor a causal LM transformers lists. The rest of
    the fallback's checks (remote code, encoder-decoder, attention interface) are the engine's."""
    if model_impl in ("kvtide", "vllm"):
        resolve_architecture(architectures)
        return
    if model_impl != "auto" or is_native(architectures) or config.get("is_encoder_decoder") \
            or "auto_map" in config:
        return
    known = transformers_causal_lm_names()
    arch = architecture_name(architectures)
    if known is not None and arch not in known:
        raise ValueError(unsupported_architecture_message(
            architectures.architectures, f"kvtide has no native module for it, and {no_transformers_class_reason(arch)}"))


class _Architectures:
    """What resolve_architecture reads of a config (its `architectures`)."""

    def __init__(self, architectures) -> None:
        self.architectures = architectures if isinstance(architectures, list) else None


def _read_config(model_dir: str) -> dict | None:
    """config.json as a dict; None when absent or unreadable (the engine reports that itself)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                names = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []  # the loader names what is wrong with the index
        return [os.path.join(model_dir, name) for name in sorted(names)
                if os.path.isfile(os.path.join(model_dir, name))]
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def check_safetensors_header(path: str) -> None:
    """A safetensors file is an 8-byte little-endian header length, a JSON header giving each
    tensor's [begin, end) byte range, then the data: a file shorter than its header says, or whose
    header does not parse, is corrupt (the loader's ValueError)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError("shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if 8 + header_len > size:
                raise ValueError(f"header of {header_len} bytes past the end of a {size}-byte file")
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        data_end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                       default=0)
        if 8 + header_len + data_end > size:
            raise ValueError(f"tensor data ends at byte {8 + header_len + data_end}, the file has {size}")
    except OSError:
        return  # unreadable here: the loader says why
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"cannot read weights from {path} ({e}): the file is corrupt or truncated; "
                         f"download or convert the checkpoint again") from e


def has_tokenizer_files(directory: str) -> bool:
    """Whether `directory` holds any file a tokenizer could be built from."""
    for name in os.listdir(directory):
        lower = name.lower()
        if lower.startswith(TOKENIZER_FILE_HINTS) or lower.endswith(TOKENIZER_FILE_SUFFIXES):
            return True
    return False
