"""What the CPU GEMM choice (cpu_gemm.py) keeps per machine: the verdict cache on disk, how much
weight a timing streams so that it reads from memory, and the panel kernels' prefetch distance,
measured once and kept in the same cache file; and, in a file of its own, the MoE experts' choice of
product orientation (fused_moe.expert_linear), so that every process (a rank, a restart) runs the
same products without timing them again.

    cache_root()/gemm/<cpu>-<isa>-torch<v>-t<threads>-<hash of machine_key>.json
        {"machine": key, "shapes": {shape: {bucket: {candidate: seconds or null}}}, "panel_prefetch": rows}
    cache_root()/gemm/<cpu>-<isa>-torch<v>-t<threads>-<hash of expert_key>.json
        {"machine": key, "expert_linear": {"<N>x<K>/<bucket>": whether (w @ x.T).T is faster}}
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time

import torch

from kvtide.attention.cpu_extension import available_isas, build_directory
from kvtide.layers import layer_ops
from kvtide.machine import last_level_cache_bytes, machine_info
from kvtide.models.cache_dir import cache_root, private_cache_path

logger = logging.getLogger(__name__)

CACHE_VERSION = 5
"""Bumped when the candidates or the measurement change, so older verdicts are not reused."""
EXPERT_VERSION = 1
"""Bumped when fused_moe's orientation measurement changes."""
MAX_RING = 256
"""At most this many copies of a small weight in a ring streamed from memory."""


def stream_bytes() -> int:
    """Bytes a ring of weight copies spans so that going round it reads from memory: twice the
    last-level cache (64 MiB where it cannot be read), at most 256 MiB."""
    llc = last_level_cache_bytes()
    return min(2 * llc if llc else 64 << 20, 256 << 20)


# ---- the disk cache ------------------------------------------------------------------------------
def machine_key(candidates: list[str]) -> dict:
    """What a verdict depends on besides the shape: CPU, ISA, torch and its threads, candidates, and
    the panel kernel's build (its source and flags: a verdict timed on another build is not kept)."""
    info = machine_info()
    return {"cpu_model": info["cpu_model"], "isa": info["isa"], "torch": info["torch"],
            "torch_threads": info["torch_threads"], "candidates": candidates, "version": CACHE_VERSION,
            "panel_build": build_directory(available_isas()[0], layer_ops.SOURCE).name}


def expert_key() -> dict:
    """What the experts' orientation verdict depends on besides the shape: CPU, ISA, torch, threads."""
    info = machine_info()
    return {"cpu_model": info["cpu_model"], "isa": info["isa"], "torch": info["torch"],
            "torch_threads": info["torch_threads"], "what": "expert_linear", "version": EXPERT_VERSION}


def cache_path(key: dict) -> str:
    """cache_root()/gemm/<readable machine name>-<hash of the whole key>.json"""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9.+]+", "-", f"{key['cpu_model']}-{key['isa']}-torch{key['torch']}"
                  f"-t{key['torch_threads']}").strip("-")[:96]
    return os.path.join(cache_root(), "gemm", f"{slug}-{digest}.json")


def _load_file(path: str) -> dict:
    try:
        private_cache_path(os.path.dirname(path))  # 0700 and ours, or an UnsafeCacheDirError
        with open(path) as f:
            content = json.load(f)
        return content if isinstance(content, dict) else {}
    except (OSError, ValueError):
        return {}


def load_cache(path: str) -> dict[str, dict]:
    return _load_file(path).get("shapes", {})


def save_cache(path: str, key: dict, new: dict[str, dict], panel_prefetch: int | None = None) -> None:
    """Merge `new` shapes (and the panel prefetch distance) into the file."""
    content = _load_file(path)
    prefetch = panel_prefetch if panel_prefetch is not None else content.get("panel_prefetch")
    shapes = {**content.get("shapes", {}), **new}
    _write_file(path, {"machine": key, "shapes": shapes, "panel_prefetch": prefetch})


def load_expert_verdicts(path: str) -> dict[str, bool]:
    return {name: v for name, v in _load_file(path).get("expert_linear", {}).items() if isinstance(v, bool)}


def save_expert_verdict(path: str, key: dict, name: str, weight_major_wins: bool) -> None:
    verdicts = {**load_expert_verdicts(path), name: weight_major_wins}
    _write_file(path, {"machine": key, "expert_linear": verdicts})


def _write_file(path: str, content: dict) -> None:
    """Written whole to a temporary file then renamed over the old one, so concurrent readers never
    see half a file (concurrent writers may drop each other's new entries; those are measured again
    next time)."""
    private_cache_path(os.path.dirname(path))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(content, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not write the GEMM cache %s: %s", path, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass


# ---- the panel kernel's prefetch distance -----------------------------------------------------------
PANEL_PREFETCH_CHOICES = (0, 32, 128)
"""Panel rows the panel kernels may prefetch ahead (0: the hardware prefetcher alone). Streaming one
row through a weight from memory, a Zen 4 EPYC ran 15-20% faster with none; the kernel was tuned
with 32 on another machine. Measured once per machine, the first time a model is packed."""
PANEL_PREFETCH_DEFAULT = 32
"""The distance the kernel was tuned with; another is chosen only when PREFETCH_MARGIN faster."""
PREFETCH_MARGIN = 0.05
"""On a Xeon the three distances timed within 2-4% of each other, in an order that changed from run
to run, and a 128 picked that way (cached for good) made SmolLM2's one-row down projection 137 ->
185 us; a Zen 4 EPYC's win with none was 15-20%."""
PREFETCH_PROBE_SHAPE = (1536, 1024)
"""The weight (N, K) streamed to time each distance: 6 MiB, a mid-size decode linear."""


def measure_panel_prefetch(rounds: int = 5) -> dict[int, float]:
    """Seconds per 1-row panel linear over a ring of weights larger than the cache, per distance:
    the best of `rounds` interleaved passes over the whole ring (so no pass finds a copy cached)."""
    n, k = PREFETCH_PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    count = max(2, min(MAX_RING, math.ceil(stream_bytes() / (n * k * 4))))
    ring = [layer_ops.pack_panels(torch.randn(n, k, generator=gen)) for _ in range(count)]
    x = torch.randn(1, k, generator=gen)
    best = dict.fromkeys(PANEL_PREFETCH_CHOICES, math.inf)
    for _ in range(rounds + 1):  # the first round warms up
        for distance in PANEL_PREFETCH_CHOICES:
            layer_ops.set_panel_prefetch(distance)
            start = time.perf_counter()
            for panels in ring:
                layer_ops.linear_panels(x, n, panels, None)
            best[distance] = min(best[distance], (time.perf_counter() - start) / count)
    return best


def pick_panel_prefetch(timings: dict[int, float]) -> int:
    """The fastest distance of `timings`, if PREFETCH_MARGIN faster than PANEL_PREFETCH_DEFAULT."""
    fastest = min(timings, key=timings.get)
    default = timings.get(PANEL_PREFETCH_DEFAULT)
    if default is not None and timings[fastest] > default * (1 - PREFETCH_MARGIN):
        return PANEL_PREFETCH_DEFAULT
    return fastest


def choose_panel_prefetch(key: dict, use_cache: bool = True) -> int | None:
    """Set the panel kernels' prefetch distance to this machine's fastest (measured once, then read
    from the cache file of `key`); None where the panel kernel is not built."""
    if layer_ops.layer_op("linear_panels") is None:
        return None
    path = cache_path(key)
    distance = _load_file(path).get("panel_prefetch") if use_cache else None
    if distance not in PANEL_PREFETCH_CHOICES:
        timings = measure_panel_prefetch()
        distance = pick_panel_prefetch(timings)
        logger.info("GEMM panel prefetch: %d rows ahead (1-row stream, us per call: %s)", distance,
                    ", ".join(f"{d}: {t * 1e6:.0f}" for d, t in timings.items()))
        if use_cache:
            save_cache(path, key, {}, panel_prefetch=distance)
    layer_ops.set_panel_prefetch(distance)
    return distance
