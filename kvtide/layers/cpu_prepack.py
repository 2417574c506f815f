"""MKL-prepacked float32 weights for CPU decode batches: the same sums, about 20% faster.

MKL's sgemm copies the weight matrix into its kernel's panel layout on every call. At decode batch
sizes (16-256 tokens) that copy is a large share of a linear's time: on the bench machine (2-core
Sapphire Rapids) the bench model's K=768 linears took 0.76x the time with a weight packed once,
0.92x at 256 tokens, and became slower from about 1k tokens (prefill). Packing a weight once is
what inductor's freezing pass does for float32 linears
(`torch.ops.mkl._mkl_reorder_linear_weight`, then `_mkl_linear`).

Prepacking must be a speed change only. Each layer shape is probed once: the packed weight is used
only if its products are bit-identical to F.linear's at the probe sizes. On the bench machine MKL
sums K=768 in the same order packed or not, but not K=2048, so down_proj keeps F.linear there. The
probe keeps kvtide's greedy tokens identical to Hugging Face's. Below MIN_TOKENS, MKL's unpacked
path switches to another kernel with a different sum order, and it is as fast there, so small
batches keep F.linear too.

A packed weight is an extra copy of the weight. `cpu_weight_prepack='auto'` packs only when
all the copies together fit in a quarter of the memory available at load time.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

MIN_TOKENS = 16
"""Fewest rows a packed weight is used for (below: F.linear, a different MKL kernel)."""
MAX_TOKENS = 256
"""Most rows a packed weight is used for (above: packing no longer pays; prefill)."""
PROBE_TOKENS = (MIN_TOKENS, 67, MAX_TOKENS)
"""Row counts at which a packed weight must equal F.linear bit for bit before it is used."""
MODES = ("auto", "on", "off")


def check_mode(mode: str) -> None:
    """ValueError unless `mode` is a cpu_weight_prepack choice (EngineArgs checks it before loading)."""
    if mode not in MODES:
        raise ValueError(f"cpu_weight_prepack must be one of {', '.join(MODES)}; got {mode!r}")


def prepack_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through `packed` (weight prepacked by MKL) for MIN_TOKENS..MAX_TOKENS rows."""
    if packed is not None:
        rows = x.numel() // x.shape[-1]
        if MIN_TOKENS <= rows <= MAX_TOKENS:
            return _packed_linear(x, packed, weight, bias, rows)
    return F.linear(x, weight, bias)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def prepack_weights(model: nn.Module, mode: str, available_bytes: int | None = None) -> int:
    """Give each CPU float32 layer with a `prepacked` attribute (linears, LM head) its packed weight,
    where its shape passes the probe. Returns the number of layers packed. `available_bytes`
    (default: MemAvailable) bounds 'auto'."""
    check_mode(mode)
    layers = [m for m in model.modules() if hasattr(m, "prepacked") and m.weight.dtype == torch.float32
              and m.weight.device.type == "cpu"]
    if mode == "off" or not layers or not prepack_available():
        return 0
    total = sum(m.weight.nbytes for m in layers)
    if mode == "auto":
        budget = (_available_memory() if available_bytes is None else available_bytes) // 4
        if total > budget:
            logger.info("not prepacking CPU weights: %.1f GiB of copies exceed a quarter of free memory",
                        total / 2**30)
            return 0
    verdicts: dict[tuple[int, int, bool], bool] = {}
    packed = 0
    for layer in layers:
        weight, bias = layer.weight, getattr(layer, "bias", None)
        key = (weight.shape[0], weight.shape[1], bias is not None)
        if verdicts.get(key) is False:
            continue
        candidate = torch.ops.mkl._mkl_reorder_linear_weight(weight, 64)
        if key not in verdicts:
            verdicts[key] = _sums_like_unpacked(weight, bias, candidate)
        if verdicts[key]:
            layer.prepacked = candidate
            packed += 1
    logger.info("prepacked %d of %d CPU linear weights (shape verdicts: %s)", packed, len(layers),
                {f"{n}x{k}{'+bias' if b else ''}": ok for (n, k, b), ok in verdicts.items()})
    return packed


def _sums_like_unpacked(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> bool:
    """Whether the packed weight gives F.linear's exact bits at every PROBE_TOKENS row count."""
    gen = torch.Generator().manual_seed(0)
    for rows in PROBE_TOKENS:
        x = torch.randn(rows, weight.shape[1], generator=gen)
        if not torch.equal(_packed_linear(x, packed, weight, bias, rows), F.linear(x, weight, bias)):
            return False
    return True


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes; 0 where it cannot be read (then 'auto' packs nothing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
