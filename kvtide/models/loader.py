"""Build a model from a Hugging Face checkpoint: config -> our nn.Module -> safetensors weights.

Parameters are created empty in the target dtype, then each checkpoint tensor is streamed in
through its parameter's weight_loader; a parameter left unfilled is an error, not random noise.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from kvtide.models.gguf_checkpoint import prepared_weights
from kvtide.models.registry import get_model_class


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {model_dir}")
    return files


def iterate_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    gguf_weights = prepared_weights(model_dir)
    if gguf_weights is not None:
        yield from gguf_weights
        return
    for path in safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as e:  # corrupt or truncated file
            raise ValueError(f"cannot read weights from {path} ({e}): the file is corrupt or truncated; "
                             f"download or convert the checkpoint again") from e


def load_model(model_dir: str, hf_config, dtype: torch.dtype, max_model_len: int,
               device: str = "cpu") -> torch.nn.Module:
    model_cls = get_model_class(hf_config)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config, max_model_len, dtype)
    loaded = model.load_weights(iterate_weights(model_dir))
    expected = {name for name, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(sorted(missing)[:8])}")
    return model.eval()
