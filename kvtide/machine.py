"""The machine a figure was measured on: CPU model, the vector ISA torch dispatches to, cores.

Kernel speeds differ between CPUs of the same ISA (MKL runs its best sgemm path on Intel parts,
oneDNN dispatches on the ISA alone), so benchmark output and the GEMM choices cached on disk
(layers/cpu_gemm.py) both carry this description.
"""

from __future__ import annotations

import functools
import os


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ('model name', 'cpu family', ...); {} elsewhere."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model_name() -> str:
    """'model name' from /proc/cpuinfo, with family/model/stepping when the name alone is vague
    (a VM may report just 'AMD EPYC'); platform.processor() where there is no /proc/cpuinfo."""
    info = _cpuinfo()
    name = info.get("model name")
    if not name:
        import platform

        return platform.processor() or platform.machine() or "unknown CPU"
    ids = [f"{label} {info[key]}" for key, label in (("cpu family", "family"), ("model", "model"),
                                                       ("stepping", "stepping")) if key in info]
    return f"{name} ({', '.join(ids)})" if ids else name


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache of the first core (sysfs), or None where it cannot be read."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    sizes = []
    try:
        indexes = [name for name in os.listdir(base) if name.startswith("index")]
    except OSError:
        return None
    for index in indexes:
        try:
            with open(os.path.join(base, index, "size")) as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=None)


def cpu_isa() -> str:
    """The vector ISA torch's CPU kernels dispatch to (e.g. AVX512, AVX2, DEFAULT)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def machine_info() -> dict:
    """CPU model, ISA, usable cores, torch version and torch threads, for benchmark records."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": cpu_model_name(), "isa": cpu_isa(), "cores": cores,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def describe_machine(info: dict | None = None) -> str:
    """One line: 'machine: AMD EPYC (family 25, model 17, stepping 1), ISA AVX512, 2 cores, torch ...'."""
    info = info or machine_info()
    return (f"machine: {info['cpu_model']}, ISA {info['isa']}, {info['cores']} cores, "
            f"torch {info['torch']} ({info['torch_threads']} threads)")
