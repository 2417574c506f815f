"""Per-layer K/V scales of fp8 caches: from the checkpoint, or calculated from the first forward pass.

Checkpoints quantized for an fp8 KV cache ship one scale per layer under vLLM's names:
    model.layers.N.self_attn.k_scale / v_scale          (compressed-tensors, quark)
    model.layers.N.self_attn.k_proj.k_scale / v_proj.v_scale   (ModelOpt)
    model.layers.N.self_attn.kv_scale                   (older: one scale for both)
A scale with several entries (per KV head) is reduced to its largest, the per-tensor scale that
saturates nothing. int8 and k8v4 caches scale every token-head row themselves and ignore these.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvtide.kv_compression.formats import FP8_DTYPES, KVQuantFormat

_CHECKPOINT_SCALE = re.compile(r"^(?P<attn>.*\.self_attn)\.(?:[kv]_proj\.)?(?P<which>k_scale|v_scale|kv_scale)$")
CALCULATE_HEADROOM = 2.0
"""--calculate-kv-scales puts the first pass's largest |K| (|V|) at 1/HEADROOM of the fp8 range, so
later tokens up to twice as large still do not saturate."""


def load_checkpoint_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Store a checkpoint's K/V scale tensor `name` (HF name without 'model.') into its layer's
    `kv_scale`; False when `name` is not one."""
    match = _CHECKPOINT_SCALE.match(name)
    if match is None:
        return False
    try:
        attn = model.get_submodule(match["attn"] + ".attn")
    except AttributeError:
        return False
    from kvtide.layers.linear import materialize

    value = materialize(tensor).float().max()
    if not torch.isfinite(value) or value <= 0:
        raise ValueError(f"checkpoint KV scale {name!r} must be finite and > 0, got {value.item()}")
    which = {"k_scale": [0], "v_scale": [1], "kv_scale": [0, 1]}[match["which"]]
    for i in which:
        attn.kv_scale[i] = value
    return True


def calculate_kv_scale(layer: nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
    """Set `layer.kv_scale` from this pass's K/V (once), for the layer's backend format."""
    fmt: KVQuantFormat | None = layer.backend.kv_quant
    layer.calculate_kv_scales = False
    if fmt is None or key.numel() == 0:
        return
    scales = []
    for x, kind, old in ((key, fmt.k_kind, layer.kv_scale[0]), (value, fmt.v_kind, layer.kv_scale[1])):
        if kind in FP8_DTYPES:
            amax = x.abs().amax().float()
            scales.append(torch.where(amax > 0, amax * CALCULATE_HEADROOM / torch.finfo(FP8_DTYPES[kind]).max, old))
        else:
            scales.append(old)
    layer.kv_scale.copy_(torch.stack(scales))
