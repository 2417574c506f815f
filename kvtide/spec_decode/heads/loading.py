"""Reading a draft-head checkpoint directory: config.json plus its tensors, with errors that name the problem.

Head checkpoints are small (a few Medusa heads, or one decoder layer with its fc), so every tensor is
read into memory at once and a head checks the whole set of names and shapes it needs before it copies
anything: a wrong checkpoint fails at startup with one message listing what is missing, unexpected or
mis-shaped, never half-loaded.

Weights are looked up as the public checkpoints ship them: `*.safetensors` (with or without an index),
else `pytorch_model*.bin`, else FasterDecoding Medusa's `medusa_lm_head.pt`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

CONFIG_NAME = "config.json"
MEDUSA_TENSOR_RE = re.compile(r"^(medusa_head\.)?\d+\.\d+\.(linear\.)?(weight|bias)$|^blocks\.\d+\.layers\.\d+\."
                              r"(weight|bias)$|^lm_heads\.\d+\.weight$")
"""FasterDecoding's `{head}.{block}.linear.weight` / `{head}.{num_layers}.weight` and vLLM's
`blocks.{head}.layers.{block}.weight` / `lm_heads.{head}.weight`."""
_LIST_AT_MOST = 6


@dataclass
class HeadCheckpoint:
    path: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def read_head_config(path: str) -> dict[str, Any]:
    """config.json of a head checkpoint as a dict (ValueError when absent or not a JSON object)."""
    if not os.path.isdir(path):
        raise ValueError(f"draft head checkpoint {path!r} is not a directory")
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.exists(config_path):
        raise ValueError(f"draft head checkpoint {path} has no {CONFIG_NAME}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {config_path} ({e}): the file is corrupt or truncated") from e
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return config


def weight_files(path: str) -> list[str]:
    """The weight files of a head checkpoint, in the first format found (ValueError when none)."""
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        index = os.path.join(path, index_name)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"cannot read the weight index {index} ({e})") from e
            files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
            absent = [f for f in files if not os.path.exists(f)]
            if absent:
                raise ValueError(f"{index} lists weight files that are absent: {_few(absent)}")
            return files
        files = sorted(glob.glob(os.path.join(path, pattern)))
        if files:
            return files
    legacy = os.path.join(path, "medusa_lm_head.pt")
    if os.path.exists(legacy):
        return [legacy]
    raise ValueError(f"draft head checkpoint {path} has no weights (*.safetensors, pytorch_model*.bin or "
                     f"medusa_lm_head.pt)")


def _iterate_file(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
            return
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt, truncated, or not a tensor file at all
        raise ValueError(f"cannot read weights from {file} ({e}): the file is corrupt or truncated") from e
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file} does not hold a flat name -> tensor state dict")
    yield from state.items()


def read_head_tensors(path: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        for name, tensor in _iterate_file(file):
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears twice in the weights of {path}")
            tensors[name] = tensor
    return tensors


def tensor_names(path: str) -> set[str]:
    """Names of the checkpoint's tensors; safetensors files are not read beyond their header."""
    names: set[str] = set()
    for file in weight_files(path):
        if file.endswith(".safetensors"):
            try:
                with safe_open(file, framework="pt") as f:
                    names.update(f.keys())
            except Exception as e:
                raise ValueError(f"cannot read weights from {file} ({e}): the file is corrupt or truncated") from e
        else:
            names.update(name for name, _ in _iterate_file(file))
    return names


def load_head_checkpoint(path: str) -> HeadCheckpoint:
    path = os.fspath(path)
    return HeadCheckpoint(path, read_head_config(path), read_head_tensors(path))


def check_tensors(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], what: str) -> None:
    """ValueError listing every missing, unexpected and mis-shaped tensor, or nothing when the names and
    shapes are exactly `expected`."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = [f"{name} {tuple(tensors[name].shape)} (expected {tuple(shape)})"
                 for name, shape in sorted(expected.items())
                 if name in tensors and tuple(tensors[name].shape) != tuple(shape)]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_few(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {_few(misshaped)}")
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))


def _few(items: list[str]) -> str:
    shown = ", ".join(items[:_LIST_AT_MOST])
    return shown + (f" and {len(items) - _LIST_AT_MOST} more" if len(items) > _LIST_AT_MOST else "")


def detect_head_method(path: str) -> str | None:
    """"medusa", "eagle" or "eagle3" from a checkpoint's config and tensor names; None when the
    directory holds none of these layouts (or cannot be read), so the caller can say so."""
    try:
        config = read_head_config(path)
    except ValueError:
        config = {}
    try:
        names = tensor_names(path)
    except ValueError:
        names = set()
    return method_from_layout(config, names)


def method_from_layout(config: Mapping[str, Any], names: set[str] | Mapping[str, Any]) -> str | None:
    """The head method a config and set of tensor names belong to (see detect_head_method)."""
    names = {name.removeprefix("model.") for name in names}
    architectures = " ".join(str(a) for a in config.get("architectures") or []).lower()
    if (any(n.startswith("midlayer.") for n in names) or "d2t" in names or "draft_vocab_size" in config
            or "eagle3" in architectures):
        return "eagle3"
    if ("medusa_num_heads" in config or config.get("model_type") == "medusa" or "medusa" in architectures
            or any(MEDUSA_TENSOR_RE.match(n) for n in names)):
        return "medusa"
    if "fc.weight" in names and any(n.startswith("layers.") for n in names):
        return "eagle"
    return None


@contextlib.contextmanager
def construction(dtype: torch.dtype, device: str | torch.device):
    """Create parameters directly in `dtype` on `device` (no float32 CPU copy first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)
