"""`kvtide bench compare`'s engine entries: a plain engine or ENGINE:VARIANT (kvtide:int8,
kvtide:int4-g32, kvtide:gguf-Q4_0, llamacpp:Q8_0, ...), parsed and checked before any worker
starts, and what each variant loads with (the EngineArgs quantization fields; the GGUF file).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections import Counter

from kvtide.bench import peers
from kvtide.bench.common import cache_dir

ALL_ENGINES = ("kvtide", "hf", "vllm", "llamacpp")
KVTIDE_VARIANTS = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128", "fp8", "w8a8", "w4a8", "w4a8-g32",
                   "w4a8-g64", "w4a8-g128", "gguf")
FLOAT_GGUF_TYPES = ("F32", "F16", "BF16")


@dataclasses.dataclass(frozen=True)
class EngineEntry:
    """One worker of a comparison: an engine and, for ENGINE:VARIANT, the configuration it runs."""

    label: str  # in tables and JSON: kvtide, kvtide:int8, llamacpp:Q4_0
    engine: str  # the adapter (engines.py): kvtide, hf, vllm, llamacpp
    variant: str | None = None
    quantization: str | None = None  # kvtide: the method it quantizes the checkpoint with at load
    group_size: int | None = None  # kvtide int4; None: the engine's default
    gguf_type: str | None = None  # llamacpp: the type llama.cpp quantizes the float GGUF to
    from_gguf: bool = False  # kvtide:gguf: the model is the GGUF file llama.cpp gets


def parse_engine(text: str) -> EngineEntry:
    """`kvtide`, `kvtide:int4-g32`, `llamacpp:Q4_K_M` ... as an EngineEntry; ValueError naming the
    choices for anything else, so a typo stops the run before any worker starts."""
    name, sep, variant = text.strip().partition(":")
    engine = name.strip().lower()
    if engine not in ALL_ENGINES:
        raise ValueError(f"--engines: unknown engine {text!r}; choose from {', '.join(ALL_ENGINES)} "
                         f"(variants: {_variant_help()})")
    if not sep:
        return EngineEntry(engine, engine)
    variant = variant.strip()
    if engine == "kvtide":
        v = variant.lower().replace("_", "-")
        if v.startswith("gguf-"):  # kvtide on the very file llamacpp:TYPE runs
            t = variant[len("gguf-"):].upper().replace("-", "_")
            if t not in peers.LLAMACPP_QUANT_TYPES:
                raise ValueError(f"--engines: unknown llama.cpp type in {text!r}; choose from "
                                 f"{', '.join('kvtide:gguf-' + k for k in peers.LLAMACPP_QUANT_TYPES)}")
            return EngineEntry(f"kvtide:gguf-{t}", "kvtide", f"gguf-{t}", gguf_type=t, from_gguf=True)
        if v not in KVTIDE_VARIANTS:
            raise ValueError(f"--engines: unknown kvtide variant {text!r}; choose from "
                             f"{', '.join('kvtide:' + k for k in KVTIDE_VARIANTS)}")
        if v == "gguf":
            return EngineEntry(f"kvtide:{v}", "kvtide", v, from_gguf=True)
        method, _, group = v.partition("-g")
        return EngineEntry(f"kvtide:{v}", "kvtide", v, quantization=method, group_size=int(group) if group else None)
    if engine == "llamacpp":
        t = variant.upper()
        if t not in peers.LLAMACPP_QUANT_TYPES:
            raise ValueError(f"--engines: unknown llama.cpp type {text!r}; choose from "
                             f"{', '.join('llamacpp:' + k for k in peers.LLAMACPP_QUANT_TYPES)}")
        return EngineEntry(f"llamacpp:{t}", "llamacpp", t, gguf_type=t)
    raise ValueError(f"--engines: {engine} has no variants ({text!r}); variants: {_variant_help()}")


def _variant_help() -> str:
    return f"kvtide:{{{','.join(KVTIDE_VARIANTS)}}}, llamacpp:{{{','.join(peers.LLAMACPP_QUANT_TYPES)}}}"


def base_label(entries: list[EngineEntry]) -> str | None:
    """The entry every ratio divides by: plain kvtide, else the first kvtide entry (None: no ratios)."""
    labels = [e.label for e in entries]
    if "kvtide" in labels:
        return "kvtide"
    return next((e.label for e in entries if e.engine == "kvtide"), None)


def check_quantization_flags(args, entries: list[EngineEntry]) -> None:
    """With kvtide variants, the EngineArgs quantization flags would make plain kvtide (the
    baseline) quantized too, under a label that does not say so: refuse them; --calibration-data
    is the one a variant name cannot carry, and goes to kvtide:w8a8."""
    variants = [e for e in entries if e.engine == "kvtide" and e.variant]
    if not variants:
        return
    given = [flag for flag, value in (("--quantization", getattr(args, "quantization", None)),
                                      ("--quantization-group-size", getattr(args, "quantization_group_size", None)))
             if value is not None]
    if given:
        raise ValueError(f"{' and '.join(given)} with kvtide variants in --engines: plain kvtide is the float "
                         f"baseline; name each configuration as a variant instead (kvtide:int8, kvtide:int4-g32)")
    if getattr(args, "calibration_data", None) and not any(e.quantization == "w8a8" for e in variants):
        raise ValueError("--calibration-data with kvtide variants applies to kvtide:w8a8, which --engines lacks")


def engine_kwargs_for(entry: EngineEntry, cli_kwargs: dict, variants_listed: bool = False) -> dict:
    """The EngineArgs fields a kvtide entry's worker loads with: the CLI's, with the variant's
    quantization fields over them (all three set, so nothing of another configuration leaks in).
    `variants_listed`: kvtide variants are in the list, so --calibration-data is kvtide:w8a8's."""
    kwargs = dict(cli_kwargs)
    if entry.engine != "kvtide":
        return kwargs
    if not entry.variant:
        if variants_listed:
            kwargs.pop("calibration_data", None)
        return kwargs
    kwargs["quantization"] = entry.quantization  # kvtide:gguf: None, the engine reads the file's types
    kwargs["quantization_group_size"] = entry.group_size
    kwargs["calibration_data"] = cli_kwargs.get("calibration_data") if entry.quantization == "w8a8" else None
    for key in ("quantization", "quantization_group_size", "calibration_data"):
        if kwargs[key] is None:
            del kwargs[key]
    return kwargs


def variant_record(entry: EngineEntry, cli_kwargs: dict) -> dict:
    """What summary['variants'][label] says of an entry before it runs (GGUF facts added later)."""
    kwargs = engine_kwargs_for(entry, cli_kwargs) if entry.engine == "kvtide" else {}
    method = kwargs.get("quantization")
    group = kwargs.get("quantization_group_size")
    if method == "int4" and group is None:
        from kvtide.layers.quantization.online import Int4Config

        group = Int4Config().group_size
    return {"engine": entry.engine, "variant": entry.variant, "quantization": method, "group_size": group,
            "gguf_type": entry.gguf_type, "gguf_path": None}


@functools.cache
def gguf_weight_type(path: str) -> tuple[str, bool]:
    """(type as llama.cpp names a file's, e.g. F32, Q4_1, Q4_K_M; whether every matrix is float)."""
    from gguf import LlamaFileType

    from kvtide.models.gguf_checkpoint import open_gguf

    reader = open_gguf(path)
    matrices = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    is_float = all(t in FLOAT_GGUF_TYPES for t in matrices)
    field = reader.fields.get("general.file_type")
    try:
        name = LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (AttributeError, TypeError, ValueError):  # no general.file_type: the commonest matrix type
        name = matrices.most_common(1)[0][0] if matrices else "?"
    return name, is_float


def quantized_gguf_path(source: str, gguf_type: str) -> str:
    """Where llamacpp:TYPE's GGUF is cached: beside the float one as <name>-<TYPE>.gguf (its -f32/-f16/
    -bf16 suffix dropped), or in the bench cache when that directory is not writable."""
    stem = re.sub(r"-(f32|f16|bf16)$", "", os.path.splitext(os.path.basename(source))[0], flags=re.IGNORECASE)
    directory = os.path.dirname(os.path.abspath(source))
    if not os.access(directory, os.W_OK):
        directory = cache_dir("bench-models")
    return os.path.join(directory, f"{stem}-{gguf_type}.gguf")


