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
so its output dimension is not packed). A tensor-parallel rank takes its part of each checkpoint
tensor by the same bookkeeping (`rank_part`): a column-parallel layer its output rows, a row-parallel
one its input columns, in whole packed elements and groups.
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

    def check_parallel(self, hf_config, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Raise ValueError for a multi-rank replica this scheme cannot shard (before any process
        starts). By default each rank loads its shard of the checkpoint (`rank_part`) or quantizes its
        float shard after loading, and each pipeline stage its own layers."""

    def expert_quantizer(self):
        """How a MoE layer's float experts are quantized after loading (one expert's (N, K) weight ->
        its QuantizedWeight), or None: they stay float (checkpoint formats)."""
        return None

    def experts_method_for(self, prefix: str, moe: nn.Module):
        """The method that loads a MoE layer's experts in the checkpoint's format (create_weights,
        process_weights_after_loading -> (w13 parts, w2 parts)), or None: float experts."""
        return None

    def expert_kernel(self):
        """The GEMM of a quantized expert, (x, QuantizedWeight, bias) -> y, or None: the weight-only
        kernel (weight_only.quantized_linear, which finish_quantization fills in)."""
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


def shard_input_widths(hf_config, tp: int) -> list[tuple[str, int, int]]:
    """(what, whole width, one rank's width) of the input columns of each kind of linear under
    tensor parallelism: column-parallel layers read the whole hidden state, row-parallel ones
    (o_proj, down_proj) their 1/tp of the heads or of the MLP. Experts split whole (expert
    parallelism) keep their width."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    heads = hf_config.num_attention_heads * head_dim
    intermediate = getattr(hf_config, "intermediate_size", None) or hf_config.hidden_size
    widths = [("hidden_size", hf_config.hidden_size, hf_config.hidden_size),
              ("intermediate_size", intermediate, intermediate // tp),
              ("num_attention_heads * head_dim", heads, heads // tp)]
    if getattr(hf_config, "moe_intermediate_size", None):
        widths.append(("moe_intermediate_size", hf_config.moe_intermediate_size, hf_config.moe_intermediate_size))
    shared = getattr(hf_config, "shared_expert_intermediate_size", None)  # Qwen2-MoE: split like a dense MLP
    if shared:
        widths.append(("shared_expert_intermediate_size", shared, shared // tp))
    return widths


def check_shard_widths(what: str, group: int, hf_config, tp: int, suggest: tuple[int, ...] = ()) -> None:
    """ValueError unless `group` input columns (a quantization group or packed block, `what`)
    divide every rank's part of a split input width under tensor_parallel_size=tp (the widths
    nothing splits are the world-size-1 checks' business)."""
    for name, whole, width in shard_input_widths(hf_config, tp):
        if width != whole and width % group:
            fits = [str(g) for g in suggest if width % g == 0]
            hint = f"; pick one of {', '.join(fits)}" if fits else ""
            raise ValueError(f"{what} {group} does not divide each rank's shard of the model's {name}: {whole} / "
                             f"tensor_parallel_size={tp} = {width} input columns{hint}, or a smaller "
                             f"tensor_parallel_size")


def rank_part(layer: nn.Module, loaded: torch.Tensor, shard_id: object, local_shape: tuple[int, ...], name: str,
              output_dim: int | None, pack: int = 1, input_dim: int | None = None, input_pack: int = 1
              ) -> torch.Tensor:
    """This tensor-parallel rank's part of a checkpoint tensor (the whole of it at world size 1):

        column-parallel (and the vocabulary-parallel LM head): its rows along output_dim,
            [checkpoint_rows / pack, + rows / pack)     (AWQ / packed zero points: 8 rows an element)
        row-parallel: its input columns along input_dim,
            [rank * in_per_rank / input_pack, + in_per_rank / input_pack)
            (GPTQ's qweight: 8 input rows an int32; scales and zeros: one a group of columns)

    A tensor that already has the rank's size along that dimension is shared by all ranks (a
    per-channel scale of a row-parallel layer, a replicated KV head) and is taken whole. A rank's
    part that starts or ends inside a packed element or a group is a ValueError naming it."""
    tp = getattr(layer, "tp", None)
    if tp is None or tp.world_size == 1:
        return loaded
    from kvtide.layers.embedding import VocabEmbedding
    from kvtide.layers.linear import ColumnParallelLinear, RowParallelLinear

    if isinstance(layer, RowParallelLinear):
        if input_dim is None:
            return loaded
        size = layer.input_size_per_partition
        return _narrow_part(loaded, input_dim, local_shape[input_dim], tp.rank_in_group * size, size, input_pack,
                            f"{name}: this rank's {size} input columns (tensor_parallel_size={tp.world_size})",
                            "input columns per element or group")
    if output_dim is None:
        return loaded
    if isinstance(layer, ColumnParallelLinear):
        offset, size = layer.checkpoint_rows(shard_id), shard_range(layer, shard_id)[1]
    elif isinstance(layer, VocabEmbedding):  # its rows of the vocabulary, then zero rows up to the padded split
        padded, size = -(-layer.vocab_size // tp.world_size), layer.rows_here
        part = _narrow_part(loaded, output_dim, size // pack, layer.vocab_start, size, pack,
                            f"{name}: this rank's {size} vocabulary rows (tensor_parallel_size={tp.world_size})",
                            "output rows per element")
        if (padded - size) % pack:
            raise ValueError(f"{name}: the vocabulary ({layer.vocab_size}) split over tensor_parallel_size="
                             f"{tp.world_size} pads a rank to {padded} rows, which does not align with the "
                             f"checkpoint's {pack} output rows per element")
        pad = list(part.shape)
        pad[output_dim] = (padded - size) // pack
        return torch.cat([part, part.new_zeros(pad)], dim=output_dim) if pad[output_dim] else part
    else:
        return loaded
    return _narrow_part(loaded, output_dim, local_shape[output_dim], offset, size, pack,
                        f"{name}: this rank's {size} output rows (tensor_parallel_size={tp.world_size})",
                        "output rows per element")


def _narrow_part(loaded: torch.Tensor, dim: int, local: int, offset: int, size: int, pack: int, what: str,
                 unit: str) -> torch.Tensor:
    if loaded.dim() <= dim or loaded.shape[dim] == local:
        return loaded
    if offset % pack or size % pack:
        raise ValueError(f"{what} at {offset} do not align with the checkpoint's {pack} {unit}")
    if (offset + size) // pack > loaded.shape[dim]:
        raise ValueError(f"{what} at {offset} lie outside the checkpoint's {loaded.shape[dim]} elements along "
                         f"dimension {dim} ({pack} {unit})")
    return loaded.narrow(dim, offset // pack, size // pack)


def quant_parameter(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                    output_dim: int | None = 0, pack: int = 1, per_shard: bool = False,
                    optional: bool = False, input_dim: int | None = None, input_pack: int = 1,
                    rank_sliced: bool = False) -> nn.Parameter:
    """Register a checkpoint-format parameter on `layer`.

    output_dim: the dimension that runs over output rows (None: shared by all rows, e.g. g_idx,
    which every shard of a fused layer must carry identically). pack: output rows per element along
    it. per_shard: one entry per fused shard along dim 0 (per-tensor scales: a fused qkv has three).
    optional: a checkpoint may lack it (GPTQ's g_idx without act-order). input_dim / input_pack:
    the dimension over input columns (groups count as columns / group size) and columns per element,
    recorded for a row-parallel split (GPTQ's qweight packs 8 input rows per int32). Under tensor
    parallelism the loader keeps the rank's part (`rank_part`), unless rank_sliced: the caller's
    loader hands it the part already."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    shard_ids = getattr(layer, "shard_ids", (None,))

    def weight_loader(p: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        target = p.data
        if not per_shard and not rank_sliced:
            loaded = rank_part(layer, loaded, shard_id, tuple(p.shape) if shard_id is None else _shard_shape(
                layer, p, shard_id, output_dim, pack), name, output_dim, pack, input_dim, input_pack)
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


def loaded(param: nn.Parameter | None) -> bool:
    """Whether an optional parameter received a checkpoint tensor (its
    weight_loader, from quant_parameter, marks it)."""
    return param is not None and getattr(param, "shard_seen", False)


def _shard_shape(layer: nn.Module, p: nn.Parameter, shard_id: object, output_dim: int | None,
                 pack: int) -> tuple[int, ...]:
    """The shape of one fused shard's part of parameter `p` (its rows along output_dim)."""
    shape = list(p.shape)
    if output_dim is not None:
        shape[output_dim] = shard_range(layer, shard_id)[1] // pack
    return tuple(shape)


def drop_parameters(layer: nn.Module, *names: str) -> None:
    for name in names:
        if name in layer._parameters:
            del layer._parameters[name]
