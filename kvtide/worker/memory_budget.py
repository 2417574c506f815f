"""Where an engine's memory goes, measured once at startup: the weights as the checkpoint stores
them and as the engine holds them, the GEMM kernels' packed copies, the KV pool, and the rest of
the process's resident memory (the runtime: torch, the interpreter, buffers).

A quantized GGUF is held decoded into the engine's code layout (bigger than its blocks, far smaller
than float32) and a float model on CPU may keep packed copies of its weights beside them, so "the
model is N MiB" says little without the four numbers side by side. Logged at startup and exported
on /metrics as kvtide:memory_bytes{kind}.

Resident memory is read from /proc/self/statm (this process: under tensor or pipeline parallelism,
rank 0's part; other ranks run in processes of their own). On CPU, runtime = resident - weights as
held - packed copies - KV pool; on an accelerator the weights and the pool live in device memory,
so runtime is the whole host-resident figure.
"""

from __future__ import annotations

import json
import os
import struct

import torch
from torch import nn

KINDS = ("weights_stored", "weights_held", "packed_copies", "kv_pool", "runtime")
"""The budget's parts, in the order the log line names them."""
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def resident_bytes() -> int | None:
    """This process's resident set size, or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def stored_weight_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's tensors as stored: a GGUF's tensor data (its quantized blocks), a
    safetensors file's data section, a torch checkpoint's file size."""
    from kvtide.models.gguf_checkpoint import MARKER

    marker = os.path.join(model_dir, MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            return sum(_entry_bytes(entry) for entry in json.load(f)["tensors"])
    total = 0
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if name.endswith(".safetensors"):
            total += _safetensors_data_bytes(path)
        elif name.endswith(WEIGHT_FILE_SUFFIXES) and os.path.isfile(path):
            total += os.path.getsize(path)
    return total


def _entry_bytes(entry: dict) -> int:
    """A GGUF index entry's bytes in the file: its own range, or its parts' (gpt-oss's expert
    tensors put back together from llama.cpp's split gate and up tensors)."""
    if "nbytes" in entry:
        return int(entry["nbytes"])
    return sum(int(part["nbytes"]) for part in entry["parts"])


def _safetensors_data_bytes(path: str) -> int:
    """The data section of a safetensors file: its size less the 8-byte length and the JSON header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    return os.path.getsize(path) - 8 - header_len


def packed_copy_bytes(model: nn.Module) -> int:
    """Bytes of the packed weight copies the CPU GEMM chooser made (layers/cpu_gemm.py), each once.
    An opaque copy (MKL's packed weight, a tensor without storage) counts as its layer's weight,
    as cpu_gemm's own estimate does."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        plan = getattr(module, "gemm_plan", None)
        if plan is None:
            continue
        for copy in plan.packed.values():
            if copy.layout != torch.strided:
                total += module.weight.nbytes
            elif copy.data_ptr() not in seen:
                seen.add(copy.data_ptr())
                total += copy.nbytes
    return total


def memory_budget(model: nn.Module, weights_held: int, kv_pool: int, model_dir: str, device: str
                  ) -> dict[str, int]:
    """kind -> bytes (KINDS), with "resident" added where /proc gives it."""
    budget = {"weights_stored": stored_weight_bytes(model_dir), "weights_held": weights_held,
              "packed_copies": packed_copy_bytes(model), "kv_pool": kv_pool}
    resident = resident_bytes()
    if resident is None:
        budget["runtime"] = 0
        return budget
    on_host = weights_held + budget["packed_copies"] + kv_pool if device == "cpu" else 0
    budget["runtime"] = max(0, resident - on_host)
    budget["resident"] = resident
    return budget


def describe(budget: dict[str, int]) -> str:
    """The startup log line."""
    mib = {kind: value / 2**20 for kind, value in budget.items()}
    line = (f"memory: weights {mib['weights_stored']:.1f} MiB as stored, {mib['weights_held']:.1f} MiB as held; "
            f"packed copies {mib['packed_copies']:.1f} MiB; KV pool {mib['kv_pool']:.1f} MiB; "
            f"runtime {mib['runtime']:.1f} MiB")
    if "resident" in budget:
        line += f" (resident {mib['resident']:.1f} MiB)"
    return line
