"""The accelerators this node offers, as the processes that place engines on them see it.

torch is asked only when the device may be CUDA (`--device cpu` never imports it here), and only
here: the engine's placement code (engine/dp_placement.py) and the engine core deal in device names
and CUDA_VISIBLE_DEVICES strings, not in device code.
"""

from __future__ import annotations

import os


def uses_cuda(device: str) -> bool:
    """Whether an engine with `--device device` runs on CUDA ("auto": when torch sees a GPU)."""
    if device == "cpu":
        return False
    import torch

    return device == "cuda" or torch.cuda.is_available()


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (its list if set, else indices)."""
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [d.strip() for d in listed.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]
