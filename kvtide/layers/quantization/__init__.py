"""Weight quantization: which scheme a model runs with, and the hooks that apply it at load.

A checkpoint declares its format (config.json's `quantization_config.quant_method`, or a GGUF file's
quantized tensor types) and is served in it; `--quantization NAME` forces a check against that
declaration, or quantizes a float checkpoint at load (int8, int4, fp8, w8a8, w4a8).

    load_model: construct -> prepare_quantization (each layer's method creates its parameters)
                -> load_weights -> finish_quantization (each layer's QuantizedWeight)
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from torch import nn

from kvtide.layers.quantization.base import QuantizationConfig, drop_parameters
from kvtide.layers.quantization.weight_only import BUFFERS, install, quantized_linear

logger = logging.getLogger(__name__)

ONLINE_METHODS = ("int8", "int4", "fp8", "w8a8", "w4a8")
"""Quantize a float checkpoint at load."""
CHECKPOINT_METHODS = {
    "gptq": "kvtide.layers.quantization.gptq:GPTQConfig",
    "awq": "kvtide.layers.quantization.awq:AWQConfig",
    "compressed-tensors": "kvtide.layers.quantization.compressed_tensors:CompressedTensorsConfig",
    "fp8": "kvtide.layers.quantization.fp8_checkpoint:Fp8CheckpointConfig",
    "gguf": "kvtide.layers.quantization.gguf:GGUFConfig",
    "mxfp4": "kvtide.layers.quantization.mxfp4:Mxfp4Config",
}
"""quant_method as checkpoints declare it -> the config that reads that format."""
QUANTIZATION_METHODS = tuple(dict.fromkeys(ONLINE_METHODS + tuple(CHECKPOINT_METHODS)))


def declared_method(hf_config, model_dir: str | None) -> tuple[str, dict[str, Any]] | None:
    """(quant_method, its config dict) the checkpoint declares; None for a float checkpoint."""
    from kvtide.models.gguf_checkpoint import gguf_quantized_tensor_types

    if model_dir is not None:
        gguf_types = gguf_quantized_tensor_types(model_dir)
        if gguf_types:
            return "gguf", {"model_dir": model_dir}
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method not in CHECKPOINT_METHODS or method == "gguf":
        raise ValueError(f"the checkpoint's quantization_config declares quant_method {method or None!r}, which "
                         f"kvtide does not read; supported: {', '.join(m for m in CHECKPOINT_METHODS if m != 'gguf')}")
    return method, qc


def resolve_quantization(name: str | None, hf_config, model_dir: str | None, group_size: int | None = None,
                         calibration_data: str | None = None, device: str = "cpu") -> QuantizationConfig | None:
    """The QuantizationConfig a model loads with (None: float), checked against the checkpoint."""
    if name is not None:
        name = name.lower().replace("_", "-")
        if name not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {name!r}")
    declared = declared_method(hf_config, model_dir)
    if declared is not None:
        method, qc = declared
        if name is not None and name != method:
            raise ValueError(f"the checkpoint is {method}-quantized; --quantization {name} disagrees (leave it out "
                             f"to serve the checkpoint's own format)")
        if group_size is not None or calibration_data is not None:
            raise ValueError(f"--quantization-group-size and --calibration-data apply to on-the-fly quantization, "
                             f"not to a {method} checkpoint")
        config = _checkpoint_config(method, qc)
    elif name is None:
        if group_size is not None or calibration_data is not None:
            raise ValueError("--quantization-group-size and --calibration-data need --quantization")
        return None
    elif name not in ONLINE_METHODS:
        raise ValueError(f"--quantization {name} reads {name} checkpoints, and this checkpoint is not one (its "
                         f"config.json has no quantization_config); to quantize it at load use one of "
                         f"{', '.join(ONLINE_METHODS)}")
    else:
        config = _online_config(name, group_size, calibration_data)
    if device not in config.supported_devices():
        raise ValueError(f"{config.describe()} runs on {', '.join(config.supported_devices())}, not {device}")
    config.check_model(hf_config)
    return config


def _checkpoint_config(method: str, qc: dict[str, Any]) -> QuantizationConfig:
    module, _, cls = CHECKPOINT_METHODS[method].partition(":")
    return getattr(importlib.import_module(module), cls).from_config(qc)


def _online_config(name: str, group_size: int | None, calibration_data: str | None) -> QuantizationConfig:
    from kvtide.layers.quantization import online

    if name not in ("int4", "w4a8") and group_size is not None:
        raise ValueError(f"--quantization-group-size applies to int4 and w4a8, not {name}")
    if name != "w8a8" and calibration_data is not None:
        raise ValueError(f"--calibration-data applies to w8a8, not {name}")
    if name == "int8":
        return online.Int8Config()
    if name == "int4":
        return online.Int4Config(group_size)
    if name == "w4a8":
        return online.W4A8Config(group_size)
    if name == "fp8":
        return online.Fp8Config()
    from kvtide.layers.quantization.w8a8 import W8A8Config

    return W8A8Config(calibration_data)


# ---- the load-time hooks -----------------------------------------------------------------------
def _quantizable(module: nn.Module) -> bool:
    from kvtide.layers.embedding import VocabEmbedding
    from kvtide.layers.linear import LinearBase

    return isinstance(module, LinearBase | VocabEmbedding) and not getattr(module, "never_quantize", False)


def prepare_quantization(model: nn.Module, config: QuantizationConfig) -> None:
    """Give each layer the config picks a method, which creates the parameters it loads. A tied LM
    head takes its embedding's method and, after loading, its QuantizedWeight."""
    config.bind_model(model)
    model.quant_config = config  # the model's load_weights asks it about tensors with no parameter
    for prefix, module in model.named_modules():
        if hasattr(module, "quantize_experts"):  # a MoE layer's experts, in the checkpoint's format
            module.experts_quant_method = config.experts_method_for(prefix, module)
            if module.experts_quant_method is not None:
                module.experts_quant_method.create_weights(module)
            continue
        if not _quantizable(module) or getattr(module, "tied_to", None) is not None:
            continue
        method = config.method_for(prefix, module)
        module.quant_method = method
        if method is not None:
            method.create_weights(module)
    for module in model.modules():
        tied = getattr(module, "tied_to", None)
        if tied is not None:
            module.quant_method = tied.quant_method
            if "weight" not in tied._parameters:  # the table loads in its format
                drop_parameters(module, "weight")


def finish_quantization(model: nn.Module) -> int:
    """Turn every quantized layer's loaded parameters into its QuantizedWeight; returns how many."""
    done = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or getattr(module, "tied_to", None) is not None:
            continue
        qw = method.process_weights_after_loading(module)
        install(module, qw)
        done += 1
    for module in model.modules():
        tied = getattr(module, "tied_to", None)
        if tied is not None and tied.quant_method is not None:
            install(module, tied.quantized)
    config = getattr(model, "quant_config", None)
    quantize_expert = config.expert_quantizer() if config is not None else None
    expert_kernel = (config.expert_kernel() if config is not None else None) or quantized_linear
    for module in model.modules():
        if not hasattr(module, "quantize_experts"):  # not a MoE layer's experts
            continue
        method = getattr(module, "experts_quant_method", None)
        if method is not None:
            module.set_quantized_experts(*method.process_weights_after_loading(module), expert_kernel)
            done += 1
        elif quantize_expert is not None:
            module.quantize_experts(quantize_expert, expert_kernel)
            done += 1
    return done


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held (quantized tensors at their size; a tied table once)."""
    seen: set[int] = set()
    total = 0
    tensors = list(model.parameters()) + [b for name, b in model.named_buffers()
                                          if name.rsplit(".", 1)[-1] in BUFFERS]
    for tensor in tensors:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.nbytes
    return total
