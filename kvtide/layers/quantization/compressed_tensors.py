"""compressed-tensors checkpoints (llm-compressor's exports): a scheme per group of layers, each
stored in one of the library's compression formats and converted once at load.

quantization_config: `config_groups` {name: {"targets": ["Linear"] or module names / "re:"
regexes, "weights": args, "input_activations": args or null, "format"}}, a global `format`
("mixed-precision" when groups differ) and `ignore` (module names / regexes / class names left
float, usually ["lm_head"]). args: num_bits, type (int | float), symmetric, strategy (tensor |
channel | group | block | token), group_size, block_structure, dynamic, actorder. A module takes
the group whose target names it most specifically (exact name, then regex, then class).

Formats, per linear of N output and K input features:
  pack-quantized   int weights without activation quantization (W4A16, W8A16):
                   weight_packed int32 (N, K * bits / 32), 32 / bits consecutive input columns per
                   int32, lowest bits first, each value stored as q + 2^(bits-1) (q is signed);
                   weight_scale (N, K / group) or (N, 1); weight_shape [N, K]; for asymmetric
                   schemes weight_zero_point, signed, packed the same way but along the OUTPUT
                   dim ((ceil(N * bits / 32), groups)); weight_g_idx (K,) with actorder "group"
                   (the columns stay in checkpoint order, g_idx names each one's group, as GPTQ's)
  int-quantized    int8 W8A8: weight int8 (N, K); weight_scale (N, 1) or per tensor; input_scale
                   (per tensor) for static activations, none for dynamic per-token ones
  float-quantized  FP8: weight float8_e4m3fn (N, K); weight_scale per tensor, (N, 1), or per
                   block (ceil(N / bn), ceil(K / bk)); input_scale for static activations
  naive-quantized  the same tensors as int-/float-quantized for any scheme, unpacked (int values
                   in an int8 tensor); read as the format its scheme would otherwise use
and w = scale * (q - zero_point). Weight-only int schemes run the weight-only kernels; W8A8 int
runs W8A8Method (int8 activations: static scale, or per token when dynamic); FP8 runs Fp8Method
(weight-only on CPU, so input_scale is unused there). A per-tensor scale of each shard of a fused
layer becomes per-row scales (exact); the static input scales of a fused layer's shards become
their maximum, since the fused projection quantizes its input once (as vLLM does).

Refused with a message: sparsity (2:4, bitmask), Marlin-24 and NVFP4 formats, KV-cache and
output-activation quantization, transforms, asymmetric activations, FP8 group strategies.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from kvtide.layers.quantization.base import (
    QuantizationConfig,
    QuantizeMethod,
    check_shard_widths,
    checkpoint_modules,
    drop_parameters,
    loaded,
)
from kvtide.layers.quantization.fp8_checkpoint import create_fp8_weights, fp8_weight, row_scale_parameter
from kvtide.layers.quantization.fp8_method import Fp8Method
from kvtide.layers.quantization.gptq import (
    checked_parameter,
    group_order,
    int_weight,
    local_g_idx,
    unpack_int32,
)
from kvtide.layers.quantization.qweight import QuantizedWeight
from kvtide.layers.quantization.w8a8 import W8A8Method
from kvtide.layers.quantization.weight_only import WeightOnlyMethod

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


# ---- the config's schemes -------------------------------------------------------------------------
def normalize_args(args: dict[str, Any] | None) -> dict[str, Any] | None:
    """QuantizationArgs with its defaults and inferred strategy filled in."""
    if args is None:
        return None
    group_size = args.get("group_size")
    strategy = args.get("strategy")
    if strategy is None:
        strategy = "tensor" if group_size is None else "group" if group_size > 0 else "channel"
    actorder = args.get("actorder")
    if actorder is True:
        actorder = "group"
    return {"num_bits": int(args.get("num_bits", 8)), "type": str(args.get("type", "int")),
            "symmetric": bool(args.get("symmetric", True)), "strategy": str(strategy),
            "group_size": group_size, "block_structure": args.get("block_structure"),
            "dynamic": args.get("dynamic", False), "actorder": actorder}


def scheme_kind(scheme: dict[str, Any], group: str) -> str:
    """'int' (weight-only int), 'w8a8' or 'fp8' for a supported scheme; ValueError otherwise."""
    fmt, w, a = scheme["format"], scheme["weights"], scheme["input_activations"]
    what = f"compressed-tensors config group {group!r}"
    if fmt not in FORMATS:
        raise ValueError(f"{what}: format {fmt!r} is not supported; kvtide reads {', '.join(FORMATS)}")
    if w is None:
        raise ValueError(f"{what} quantizes only activations; kvtide needs quantized weights")
    if w["dynamic"]:
        raise ValueError(f"{what}: dynamic weight quantization is not a checkpoint format kvtide reads")
    if w["type"] == "int":
        if w["strategy"] not in ("tensor", "channel", "group"):
            raise ValueError(f"{what}: int weights with strategy {w['strategy']!r} are not supported")
        if a is None:
            if w["num_bits"] not in (4, 8):
                raise ValueError(f"{what}: int weights must have 4 or 8 bits; got {w['num_bits']}")
            if fmt not in ("pack-quantized", "naive-quantized"):
                raise ValueError(f"{what}: weight-only int schemes are stored pack-quantized, not {fmt!r}")
            if w["strategy"] == "tensor" and not w["symmetric"]:
                raise ValueError(f"{what}: asymmetric per-tensor int weights are not supported")
            return "int"
        if a["type"] != "int" or a["num_bits"] != 8 or w["num_bits"] != 8:
            raise ValueError(f"{what}: of int weights with quantized activations kvtide supports W8A8 int8 only")
        if not w["symmetric"] or not a["symmetric"]:
            raise ValueError(f"{what}: W8A8 needs symmetric weights and activations (no zero points)")
        if w["strategy"] == "group" or a["strategy"] not in ("tensor", "token"):
            raise ValueError(f"{what}: W8A8 supports per-channel or per-tensor weights and per-tensor or per-token "
                             f"activations")
        if fmt not in ("int-quantized", "naive-quantized"):
            raise ValueError(f"{what}: W8A8 int schemes are stored int-quantized, not {fmt!r}")
        return "w8a8"
    if w["type"] == "float" and w["num_bits"] == 8:
        if w["strategy"] not in ("tensor", "channel", "block"):
            raise ValueError(f"{what}: FP8 weights with strategy {w['strategy']!r} are not supported")
        if w["strategy"] == "block" and len(w["block_structure"] or ()) != 2:
            raise ValueError(f"{what}: block strategy needs block_structure [rows, columns]")
        if a is not None and (a["type"] != "float" or a["num_bits"] != 8):
            raise ValueError(f"{what}: FP8 weights are supported with FP8 activations or none")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"{what}: FP8 schemes are stored float-quantized, not {fmt!r}")
        return "fp8"
    raise ValueError(f"{what}: {w['num_bits']}-bit {w['type']} weights (e.g. NVFP4) are not supported")


def target_rank(name: str, classes: tuple[str, ...], target: str) -> int | None:
    """How specifically `target` names a module: 0 its exact name, 1 a matching 're:' regex, 2 its
    class ('Linear'); None: no match."""
    if target.startswith("re:"):
        return 1 if re.match(target[3:], name) else None
    if target == name:
        return 0
    return 2 if target in classes else None


def module_classes(layer: nn.Module) -> tuple[str, ...]:
    """The Hugging Face class names a layer stands for in targets (all linears are 'Linear')."""
    from kvtide.layers.embedding import LMHead, VocabEmbedding

    if isinstance(layer, VocabEmbedding) and not isinstance(layer, LMHead):
        return ("Embedding", type(layer).__name__)
    return ("Linear", type(layer).__name__)


# ---- the methods ------------------------------------------------------------------------------------
def zero_point_parameter(layer: nn.Module, modules: dict[object, str], name: str, columns: int = 1,
                         block_rows: int = 1, column_group: int = 1) -> None:
    """An optional zero point of a symmetric scheme (shaped like its scale): exporters may write
    zeros; anything else is refused."""
    row_scale_parameter(layer, modules, name, columns, block_rows=block_rows, optional=True,
                        column_group=column_group)


def check_zero(layer: nn.Module, name: str, where: str) -> None:
    param = layer._parameters.get(name)
    if loaded(param) and bool(param.data.any()):
        raise ValueError(f"{where}: {name} is non-zero, but the scheme is symmetric")


class CTIntMethod(WeightOnlyMethod):
    """pack-quantized (or naive) int weights: W4A16, W8A16, symmetric or with zero points."""

    def __init__(self, scheme: dict[str, Any], modules: dict[object, str]) -> None:
        self.w, self.packed = scheme["weights"], scheme["format"] == "pack-quantized"
        self.modules = modules

    def create_weights(self, layer: nn.Module) -> None:
        where = next(iter(self.modules.values()))
        n, k = layer.weight.shape
        bits, strategy = self.w["num_bits"], self.w["strategy"]
        pack = 32 // bits
        group = int(self.w["group_size"]) if strategy == "group" else k
        if k % group:
            raise ValueError(f"{where}: compressed-tensors group_size {group} does not divide the input size {k}")
        if self.packed and k % pack:
            raise ValueError(f"{where}: {bits}-bit pack-quantized weights need the input size ({k}) to be a multiple "
                             f"of {pack}")
        layer.weight_rows = n
        drop_parameters(layer, "weight")
        hint = f" (the config declares {bits}-bit {strategy} weights)"
        if self.packed:
            checked_parameter(layer, self.modules, hint, "weight_packed", (n, k // pack), torch.int32,
                              output_dim=0, input_dim=1, input_pack=pack)
            shards = len(getattr(layer, "shard_ids", (None,)))
            checked_parameter(layer, self.modules, "", "weight_shape", (shards, 2), torch.int64, per_shard=True,
                              optional=True)
        else:
            checked_parameter(layer, self.modules, hint, "weight", (n, k), torch.int8, output_dim=0, input_dim=1)
        row_scale_parameter(layer, self.modules, "weight_scale", k // group, column_group=group)
        if not self.w["symmetric"]:
            if self.packed:
                checked_parameter(layer, self.modules, hint, "weight_zero_point", (-(-n // pack), k // group),
                                  torch.int32, output_dim=0, pack=pack, input_dim=1, input_pack=group)
            else:
                checked_parameter(layer, self.modules, hint, "weight_zero_point", (n, k // group), torch.int8,
                                  output_dim=0, input_dim=1, input_pack=group)
        else:
            zero_point_parameter(layer, self.modules, "weight_zero_point", k // group, column_group=group)
        if strategy == "group":
            checked_parameter(layer, self.modules, "", "weight_g_idx", (k,), torch.int32, output_dim=None,
                              optional=True, input_dim=0)
        self.shape, self.group = (n, k), group

    def process_weights_after_loading(self, layer: nn.Module) -> QuantizedWeight:
        where = next(iter(self.modules.values()))
        n, k = self.shape
        bits = self.w["num_bits"]
        offset = 1 << (bits - 1)
        if self.packed:
            self._check_shapes(layer, where)
            codes = unpack_int32(layer.weight_packed.data, bits, dim=1)[:, :k]  # stored q + offset
        else:
            codes = layer.weight.data.to(torch.int16) + offset
        if self.w["symmetric"]:
            check_zero(layer, "weight_zero_point", where)
            zero_point = torch.zeros(n, k // self.group)
        elif self.packed:
            zero_point = unpack_int32(layer.weight_zero_point.data, bits, dim=0)[:n] - offset
        else:
            zero_point = layer.weight_zero_point.data.float()
        g_idx = layer._parameters.get("weight_g_idx")
        g_idx = g_idx.data if loaded(g_idx) and not bool((g_idx.data < 0).any()) else None  # -1: column order
        perm = group_order(local_g_idx(layer, g_idx, k, self.group), k, self.group, where)
        if perm is not None:
            codes = codes.index_select(1, perm)
        # w = s * (q - zp) = s * (u - (offset + zp)) with u = q + offset the unsigned code
        qw = int_weight(codes, bits, layer.weight_scale.data, zero_point.float() + offset, self.group, perm)
        drop_parameters(layer, "weight_packed", "weight_shape", "weight", "weight_scale", "weight_zero_point",
                        "weight_g_idx")
        return qw

    def _check_shapes(self, layer: nn.Module, where: str) -> None:
        shape = layer._parameters.get("weight_shape")
        tp = getattr(layer, "tp", None)
        if not loaded(shape) or (tp is not None and tp.world_size > 1):  # the whole layer's: rank_part checked the parts
            return
        _, k = self.shape
        for i, shard in enumerate(getattr(layer, "shard_ids", (None,))):
            rows = layer.weight_rows if shard is None else layer.shard_range(shard)[1]
            if tuple(shape.data[i].tolist()) != (rows, k):
                raise ValueError(f"{self.modules.get(shard, where)}: weight_shape {shape.data[i].tolist()} does not "
                                 f"match the layer's {[rows, k]}")


class CTW8A8Method(W8A8Method):
    """int-quantized W8A8: int8 weights per channel (or tensor), int8 activations."""

    def __init__(self, scheme: dict[str, Any], modules: dict[object, str]) -> None:
        super().__init__(self._build)
        a = scheme["input_activations"]
        self.static_input = not a["dynamic"]
        self.modules = modules

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.weight.shape
        layer.weight_rows = n
        drop_parameters(layer, "weight")
        hint = " (the config declares int8 W8A8 weights)"
        checked_parameter(layer, self.modules, hint, "weight", (n, k), torch.int8, output_dim=0, input_dim=1)
        row_scale_parameter(layer, self.modules, "weight_scale", 1)
        zero_point_parameter(layer, self.modules, "weight_zero_point")
        shards = len(getattr(layer, "shard_ids", (None,)))
        checked_parameter(layer, self.modules, "", "input_scale", (shards,), torch.float32, per_shard=True,
                          optional=not self.static_input)
        checked_parameter(layer, self.modules, "", "input_zero_point", (shards,), torch.float32, per_shard=True,
                          optional=True)

    def _build(self, layer: nn.Module) -> tuple[QuantizedWeight, torch.Tensor | None]:
        where = next(iter(self.modules.values()))
        check_zero(layer, "weight_zero_point", where)
        check_zero(layer, "input_zero_point", where)
        n, k = layer.weight.shape
        qw = QuantizedWeight("int8", layer.weight.data.contiguous(), layer.weight_scale.data.contiguous(), None,
                             k, n, k)
        # The fused projection quantizes its input once: with the largest of its shards' scales.
        input_scale = layer.input_scale.data.amax().float() if self.static_input else None
        drop_parameters(layer, "weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point")
        return qw, input_scale


class CTFp8Method(Fp8Method):
    """float-quantized FP8 weights (per tensor, channel or block); weight-only on CPU."""

    def __init__(self, scheme: dict[str, Any], modules: dict[object, str]) -> None:
        super().__init__(self._build)
        w, a = scheme["weights"], scheme["input_activations"]
        self.block = tuple(int(b) for b in w["block_structure"]) if w["strategy"] == "block" else None
        self.static_input = a is not None and not a["dynamic"]
        self.modules = modules

    def create_weights(self, layer: nn.Module) -> None:
        create_fp8_weights(layer, self.modules, self.block, "weight_scale", self.static_input)
        k = layer.weight.shape[1]
        if self.block is None:
            zero_point_parameter(layer, self.modules, "weight_zero_point")
        else:
            zero_point_parameter(layer, self.modules, "weight_zero_point", -(-k // self.block[1]), self.block[0],
                                 self.block[1])
        shards = len(getattr(layer, "shard_ids", (None,)))
        checked_parameter(layer, self.modules, "", "input_zero_point", (shards,), torch.float32, per_shard=True,
                          optional=True)

    def _build(self, layer: nn.Module) -> QuantizedWeight:
        where = next(iter(self.modules.values()))
        check_zero(layer, "weight_zero_point", where)
        check_zero(layer, "input_zero_point", where)
        qw = fp8_weight(layer.weight.data, layer.weight_scale.data, None if self.block is None else self.block[1])
        drop_parameters(layer, "weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point")
        return qw


METHODS = {"int": CTIntMethod, "w8a8": CTW8A8Method, "fp8": CTFp8Method}


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: dict[str, dict[str, Any]], ignore: list[str]) -> None:
        self.groups = groups
        """group name -> {"targets", "format", "weights", "input_activations", "kind"}."""
        self.ignore = ignore

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> CompressedTensorsConfig:
        fmt = qc.get("format", "dense")
        sparsity = qc.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise ValueError(f"compressed-tensors sparsity ({sparsity.get('format')}) is not supported; use a dense "
                             f"quantized export")
        if qc.get("kv_cache_scheme"):
            raise ValueError("compressed-tensors KV-cache quantization (kv_cache_scheme) is not supported")
        if qc.get("transform_config"):
            raise ValueError("compressed-tensors transforms (transform_config) are not supported")
        groups: dict[str, dict[str, Any]] = {}
        for name, group in (qc.get("config_groups") or {}).items():
            if group.get("output_activations"):
                raise ValueError(f"compressed-tensors config group {name!r}: output activation quantization is not "
                                 f"supported")
            group_format = group.get("format") or fmt
            if group_format in ("dense", "mixed-precision"):
                raise ValueError(f"compressed-tensors config group {name!r} has no compressed format (format "
                                 f"{group_format!r}); kvtide reads compressed checkpoints only")
            scheme = {"targets": list(group.get("targets") or []), "format": group_format,
                      "weights": normalize_args(group.get("weights")),
                      "input_activations": normalize_args(group.get("input_activations"))}
            scheme["kind"] = scheme_kind(scheme, name)
            groups[name] = scheme
        if not groups:
            raise ValueError("the compressed-tensors quantization_config has no config_groups")
        return cls(groups, list(qc.get("ignore") or []))


    def check_parallel(self, hf_config, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """A row-parallel rank loads its in/tp input columns: whole groups (or blocks); act-order
        groups are scattered over the whole layer and are refused, as for GPTQ."""
        tp = tensor_parallel_size
        if tp == 1:
            return
        for name, scheme in self.groups.items():
            w = scheme["weights"]
            what = f"compressed-tensors config group {name!r}"
            if w["actorder"]:
                raise ValueError(f"{what}: act-order weights (actorder {w['actorder']!r}) do not load tensor parallel "
                                 f"(tensor_parallel_size={tp}): a row-parallel rank's input columns fall in groups "
                                 f"scattered over the whole layer; serve it with tensor_parallel_size=1")
            if w["strategy"] == "group":
                check_shard_widths(f"{what}: group_size", int(w["group_size"]), hf_config, tp)
            elif w["strategy"] == "block":
                check_shard_widths(f"{what}: the block's columns", int(w["block_structure"][1]), hf_config, tp)

    def scheme_for(self, name: str, classes: tuple[str, ...]) -> str | None:
        """The config group that quantizes module `name` (None: left float)."""
        if any(target_rank(name, classes, pattern) is not None for pattern in self.ignore):
            return None
        best: tuple[int, str] | None = None
        for group, scheme in self.groups.items():
            ranks = [r for t in scheme["targets"] if (r := target_rank(name, classes, t)) is not None]
            if ranks and (best is None or min(ranks) < best[0]):
                best = (min(ranks), group)
        return None if best is None else best[1]

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        from kvtide.layers.embedding import LMHead, VocabEmbedding

        classes = module_classes(layer)
        if isinstance(layer, VocabEmbedding) and not isinstance(layer, LMHead):
            if self.scheme_for(f"model.{prefix}", classes) is not None:
                raise ValueError(f"the compressed-tensors config quantizes the embedding model.{prefix}; kvtide keeps "
                                 f"embeddings float")
            return None
        modules = checkpoint_modules(prefix, layer, self.shard_names)
        chosen = {self.scheme_for(m, classes) for m in modules.values()}
        if len(chosen) > 1:
            raise ValueError(f"{prefix}: the shards of this fused layer ({', '.join(modules.values())}) fall in "
                             f"different compressed-tensors schemes; kvtide runs them as one kernel")
        group = chosen.pop()
        if group is None:
            return None
        scheme = self.groups[group]
        return METHODS[scheme["kind"]](scheme, modules)

    def describe(self) -> str:
        kinds = sorted({s["kind"] for s in self.groups.values()})
        return f"compressed-tensors ({', '.join(kinds)})"
