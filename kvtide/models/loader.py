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

from kvtide.distributed import get_tp_group
from kvtide.layers.quantization import finish_quantization, prepare_quantization
from kvtide.layers.quantization.base import QuantizationConfig
from kvtide.models.gguf_checkpoint import prepared_weights
from kvtide.models.lazy_tensor import LazyTensor
from kvtide.models.registry import NATIVE_IMPL, TRANSFORMERS_IMPL, get_model_class


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


def iterate_weights(model_dir: str, quant_config: QuantizationConfig | None = None, lazy: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """(checkpoint name, tensor) pairs; a GGUF kept quantized (`quant_config` gguf) yields its
    tensors' codes, scales and mins instead of float weights. `lazy`: safetensors tensors come as
    LazyTensors, read only where a weight loader narrows them (a tensor-parallel rank's slice)."""
    kept = quant_config.tensor_formats if quant_config is not None and quant_config.name == "gguf" else None
    gguf_weights = prepared_weights(model_dir, kept)
    if gguf_weights is not None:
        yield from gguf_weights
        return
    for path in safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, LazyTensor(f.get_slice(name)) if lazy else f.get_tensor(name)
        except Exception as e:  # corrupt or truncated file
            raise ValueError(f"cannot read weights from {path} ({e}): the file is corrupt or truncated; "
                             f"download or convert the checkpoint again") from e


def load_model(model_dir: str, hf_config, dtype: torch.dtype, max_model_len: int,
               device: str = "cpu", quant_config: QuantizationConfig | None = None,
               model_impl: str = NATIVE_IMPL, trust_remote_code: bool = False) -> torch.nn.Module:
    """`quant_config` (layers/quantization/): the layers it picks load in its format (or quantize
    their float weights after loading) and run its kernels. A scheme that calibrates on activations
    (w8a8 with calibration data) is left float here and finished by the model runner.
    `model_impl` (models/model_impl.py): kvtide's module, or transformers' own class with kvtide's
    attention (which alone may run a checkpoint's remote code, if `trust_remote_code`)."""
    model_cls = get_model_class(hf_config, model_impl)
    extra = {"trust_remote_code": trust_remote_code} if model_impl == TRANSFORMERS_IMPL else {}
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config, max_model_len, dtype, **extra)
        if quant_config is not None:
            prepare_quantization(model, quant_config)
    loaded = model.load_weights(iterate_weights(model_dir, quant_config, lazy=get_tp_group().world_size > 1))
    expected = {name for name, p in model.named_parameters() if not getattr(p, "optional", False)}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(sorted(missing)[:8])}")
    if quant_config is not None and not getattr(quant_config, "needs_calibration", False):
        with torch.device(device):
            finish_quantization(model)
    return model.eval()
