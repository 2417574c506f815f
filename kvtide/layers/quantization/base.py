"""How a quantization plugs into the layers: a config picks a method per layer; the method creates
the layer's checkpoint-format parameters, turns them into a `QuantizedWeight` after loading, and
runs the layer's matmul.

    QuantizationConfig.method_for(prefix, layer) -> QuantizeMethod | None  (None: stays float)
    QuantizeMethod.create_weights(layer)            before loading: the format's parameters
    QuantizeMethod.process_weights_after_loading(layer) -> QuantizedWeight (kept on the layer)
    QuantizeMethod.apply(layer, x, bias)            the forward pass

A fused layer ([q; k; v], [gate; up]) receives each checkpoint shard through its parameters'
`weight_loader(param, tensor, shard_id)`: `quant_parameter` records along which dimension a
parameter holds output rows and how many rows one element packs, so a shard lands at
offset // pack along that dimension (AWQ packs 8 output columns per int32; GPTQ packs input rows,
so its output dimension is not packed). The same bookkeeping is what a tensor-parallel rank will
slice by.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kvtide.layers.quantization.qweight import QuantizedWeight


class QuantizeMethod:
    """Per-layer behaviour of one quantization format."""

    def create_weights(self, layer: nn.Module) -> None:
        """Register the parameters the checkpoint fills (default: keep the float `weight`)."""

    def process_weights_after_loading(self, layer: nn.Module) -> QuantizedWeight | None:
        """The layer's QuantizedWeight from its loaded parameters (which it may drop)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class QuantizationConfig:
    """One quantization format or on-the-fly scheme, as read from a checkpoint or given by the user."""

    name: ClassVar[str]
    shard_names: dict[str, dict[object, str]] = {}
    """fused module -> {shard id: checkpoint module} (qkv_proj -> {"q": "q_proj", ...}), from bind_model."""

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        """The method for the layer named `prefix` ('layers.0.self_attn.qkv_proj', 'lm_head',
        'embed_tokens'); None keeps it float."""
        raise NotImplementedError

    def bind_model(self, model: nn.Module) -> None:
        """Called once before method_for, with the model being built: learn its fused modules."""
        self.shard_names = fused_shard_names(model)

    def supported_devices(self) -> tuple[str, ...]:
        return ("cpu", "cuda")

    def check_model(self, hf_config) -> None:
        """Raise ValueError for a model this scheme cannot quantize (before anything is loaded)."""

    def expert_quantizer(self):
        """How a MoE layer's float experts are quantized after loading (one expert's (N, K) weight ->
        its QuantizedWeight), or None: they stay float (checkpoint formats, w8a8)."""
        return None

    def skip_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Asked by load_weights about a checkpoint tensor that has no parameter: True skips it
        (a format's harmless extras), False leaves it an error; may raise a clearer ValueError."""
        return False

    def describe(self) -> str:
        return self.name


def fused_shard_names(model: nn.Module) -> dict[str, dict[object, str]]:
    """fused module -> {shard id: checkpoint module}, from the model's packed_modules_mapping."""
    names: dict[str, dict[object, str]] = {}
    for ckpt, (fused, shard) in getattr(model, "packed_modules_mapping", {}).items():
        names.setdefault(fused, {})[shard] = ckpt
    return names


def checkpoint_modules(prefix: str, layer: nn.Module, shard_names: dict[str, dict[object, str]]) -> dict[object, str]:
    """shard id -> the Hugging Face module name a layer's weights come from
    ('layers.0.self_attn.qkv_proj' -> {'q': 'model.layers.0.self_attn.q_proj', ...})."""
    if prefix == "lm_head":
        return {None: "lm_head"}
    parent, _, leaf = prefix.rpartition(".")
    shards = shard_names.get(leaf)
    if shards is None or getattr(layer, "shard_ids", (None,)) == (None,):
        return {None: f"model.{prefix}"}
    return {s: f"model.{parent}.{shards[s]}" for s in layer.shard_ids}


def shard_range(layer: nn.Module, shard_id: object) -> tuple[int, int]:
    """(offset, size) in output rows of a fused layer's shard; the whole layer for None."""
    if shard_id is None:
        return 0, layer.output_size
    return layer.shard_range(shard_id)


def quant_parameter(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                    output_dim: int | None = 0, pack: int = 1, per_shard: bool = False,
                    optional: bool = False, input_dim: int | None = None, input_pack: int = 1
                    ) -> nn.Parameter:
    """Register a checkpoint-format parameter on `layer`.

    output_dim: the dimension that runs over output rows (None: shared by all rows, e.g. g_idx,
    which every shard of a fused layer must carry identically). pack: output rows per element along
    it. per_shard: one entry per fused shard along dim 0 (per-tensor scales: a fused qkv has three).
    optional: a checkpoint may lack it (GPTQ's g_idx without act-order). input_dim / input_pack:
    the dimension over input columns (groups count as columns / group size) and columns per element,
    recorded for a row-parallel split (GPTQ's qweight packs 8 input rows per int32)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    shard_ids = getattr(layer, "shard_ids", (None,))

    def weight_loader(p: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        target = p.data
        if per_shard:
            index = 0 if shard_id is None else list(shard_ids).index(shard_id)
            target = target[index]
            loaded = loaded.reshape(target.shape) if loaded.numel() == target.numel() else loaded
        elif output_dim is not None and shard_id is not None:
            offset, size = shard_range(layer, shard_id)
            if offset % pack or size % pack:
                raise ValueError(f"{name}: shard {shard_id!r} of {size} rows at {offset} does not align with "
                                 f"the {pack} rows packed per element")
            target = target.narrow(output_dim, offset // pack, size // pack)
        elif output_dim is None and shard_id is not None and getattr(p, "shard_seen", False):
            if not torch.equal(target, loaded.to(target.dtype)):
                raise ValueError(f"{name}: the shards of a fused layer carry different values; kvtide runs a "
                                 f"fused projection as one kernel and needs them equal")
            return
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"{name} shape mismatch: parameter {tuple(target.shape)} vs checkpoint "
                             f"{tuple(loaded.shape)}")
        target.copy_(loaded)
        p.shard_seen = True  # type: ignore[attr-defined]

    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    param.optional = optional  # type: ignore[attr-defined]
    param.output_dim, param.output_pack = output_dim, pack  # type: ignore[attr-defined]
    param.input_dim, param.input_pack = input_dim, input_pack  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def drop_parameters(layer: nn.Module, *names: str) -> None:
    for name in names:
        if name in layer._parameters:
            del layer._parameters[name]
