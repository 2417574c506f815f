"""Decode attention per layer call on CPU: the compiled paged kernel (cpu backend) against the torch
backend's chunked gather and, when git has it, the decode mirror this kernel replaced.

    python scripts/bench_cpu_attention.py [--isa avx2] [--reps 7] [--mirror-commit 2a29042]
    python scripts/bench_cpu_attention.py --kv-cache-dtype float32,int8,fp8,k8v4 --layers 16 --smollm2

`--kv-cache-dtype` (a comma-separated list) times every backend on caches of each dtype, interleaved
(the mirror only on float32); `--layers` caches per step: enough that they exceed the last-level
cache whatever their dtype, as a real model's do, or a 4x smaller quantized cache gets the edge of
staying cached. `--smollm2` adds 16 rows x ctx 1024 at SmolLM2's heads.

Each figure is the median (and the min) over --reps interleaved repetitions (the alternatives take
turns, so a noisy neighbour slows all of them alike) of one decode step over LAYERS caches, divided
by LAYERS, with seq_lens one longer every step as in real decoding (the mirror's steady state: one
append per step). `--prefill` also times short query rows over a cached context (kernel against
gather + SDPA), which is how cpu_backend.KERNEL_MAX_QUERY_LEN was chosen.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from paged_batches import make_paged_batch  # noqa: E402

from kvtide.attention import cpu_backend, cpu_extension  # noqa: E402
from kvtide.attention.backend import AttentionMetadata  # noqa: E402
from kvtide.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kvtide.kv_compression.formats import KVQuantFormat, resolve_kv_cache_dtype  # noqa: E402
from kvtide.machine import cpu_model_name  # noqa: E402

LAYERS = 4
"""Caches per step (--layers)."""
STEPS = 8
"""Decode steps per repetition (after as many warm-up steps)."""
KV_SCALE = torch.tensor([0.03, 0.02])
"""fp8 caches' K and V scales for the bench's randn K/V."""


def old_mirror_backend(commit: str) -> Callable[[], object] | None:
    """TorchAttentionBackend as of `commit` (with its decode mirror), loaded from git; None if absent."""
    if not commit:
        return None
    root = os.path.join(os.path.dirname(__file__), "..")
    try:
        source = subprocess.run(["git", "show", f"{commit}:kvtide/attention/torch_backend.py"], cwd=root,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    if "_DecodeMirror" not in source:
        return None
    spec = importlib.util.spec_from_loader("_old_torch_backend", loader=None)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, "old_torch_backend.py", "exec"), module.__dict__)
    return module.TorchAttentionBackend


def step_metadata(base: AttentionMetadata, extra: int, num_rows: int) -> AttentionMetadata:
    """The decode step `extra` tokens after `base` (every row one token longer per step)."""
    seq_lens = [s + extra for s in base.seq_lens_cpu]
    block_size = base.block_size
    slots = [int(base.block_tables[r, (s - 1) // block_size]) * block_size + (s - 1) % block_size
             for r, s in enumerate(seq_lens)]
    return AttentionMetadata(
        num_reqs=num_rows, num_decodes=num_rows, num_actual_tokens=num_rows,
        query_start_loc=base.query_start_loc, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=base.block_tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=1, max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc_cpu=base.query_start_loc_cpu, seq_lens_cpu=seq_lens, row_uids=list(range(num_rows)))


def make_caches(kv_cache: torch.Tensor, cache_dtype: str) -> tuple[list[torch.Tensor], KVQuantFormat | None]:
    """LAYERS copies of the reference-layout float32 `kv_cache` in `cache_dtype`, in the cpu/torch
    backends' layout, and the quantized format (None for a float dtype)."""
    kind = resolve_kv_cache_dtype(cache_dtype, torch.float32)
    if isinstance(kind, KVQuantFormat):
        _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        every = kv_cache.reshape(2, -1, kv_heads, head_dim)
        cache = torch.zeros(kind.cache_shape(num_blocks, block_size, kv_heads, head_dim), dtype=torch.uint8)
        kind.write(every[0], every[1], cache, torch.arange(every.shape[1]), KV_SCALE)
        return [cache.clone() for _ in range(LAYERS)], kind
    return [kv_cache.permute(0, 3, 1, 2, 4).to(kind).contiguous() for _ in range(LAYERS)], None


def bench_decode(name: str, contexts: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                 backends: dict[str, Callable[..., object]], reps: int, isa: str,
                 cache_dtypes: tuple[str, ...] = ("float32",)) -> None:
    num_rows = len(contexts)
    # Room for every step: each row's table covers context + (reps + 1) * STEPS tokens.
    batch = make_paged_batch([((reps + 1) * STEPS + 1, c - 1) for c in contexts], heads, kv_heads, head_dim, block_size,
                             torch.float32)
    base = batch.metadata
    base = AttentionMetadata(
        num_reqs=num_rows, num_decodes=num_rows, num_actual_tokens=num_rows,
        query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32), seq_lens=base.seq_lens,
        block_tables=base.block_tables, slot_mapping=base.slot_mapping, max_query_len=1,
        max_seq_len=base.max_seq_len, block_size=block_size,
        query_start_loc_cpu=list(range(num_rows + 1)), seq_lens_cpu=list(contexts))
    query = torch.randn(num_rows, heads, head_dim)
    key = torch.randn(num_rows, kv_heads, head_dim)
    value = torch.randn(num_rows, kv_heads, head_dim)
    scale = head_dim ** -0.5

    def run(backend, caches: list[torch.Tensor], first_step: int) -> float:
        quantized = caches[0].dtype == torch.uint8
        kwargs = {"kv_scale": KV_SCALE} if quantized else {}  # the mirror takes no kv_scale
        start = time.perf_counter()
        for step in range(first_step, first_step + STEPS):
            md = step_metadata(base, step, num_rows)
            for cache in caches:
                backend.forward(query, cache, md, scale, None, key, value, **kwargs)
        return (time.perf_counter() - start) / (STEPS * LAYERS)

    instances = {}
    for dtype in cache_dtypes:
        caches, kv_quant = make_caches(batch.kv_cache, dtype)
        for label, make in backends.items():
            if label == "mirror" and dtype != "float32":
                continue  # the old decode mirror knew float caches of the query's dtype only
            tag = label if cache_dtypes == ("float32",) else f"{label}[{dtype}]"
            instances[tag] = (make(kv_quant) if label != "mirror" else make(), caches)
    times: dict[str, list[float]] = {label: [] for label in instances}
    for backend, caches in instances.values():
        run(backend, caches, 0)  # warm-up (the mirror fills here)
    for rep in range(1, reps + 1):
        for label, (backend, caches) in instances.items():  # every backend at the same context lengths
            times[label].append(run(backend, caches, rep * STEPS))
    figures = ", ".join(f"{label} {statistics.median(t) * 1e6:7.0f} us (min {min(t) * 1e6:.0f})"
                        for label, t in times.items())
    print(f"{name:<44} [{cpu_model_name()}, kernel ISA {isa}, {torch.get_num_threads()} threads] {figures}",
          flush=True)


def bench_short_rows(reps: int, isa: str) -> None:
    """Rows of q_len tokens over a cached context: kernel against gather + SDPA (bench model heads)."""
    for q_len in (1, 4, 8, 12, 16, 24, 32, 64):
        batch = make_paged_batch([(q_len, 256)] * 8, 12, 4, 64, 16, torch.float32)
        cache = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous()
        kernel, sdpa = cpu_backend.CpuAttentionBackend(), TorchAttentionBackend()
        times: dict[str, list[float]] = {"kernel": [], "gather+sdpa": []}
        for _ in range(reps + 1):
            for label, backend in (("kernel", kernel), ("gather+sdpa", sdpa)):
                old = cpu_backend.KERNEL_MAX_QUERY_LEN
                cpu_backend.KERNEL_MAX_QUERY_LEN = 1 << 30
                start = time.perf_counter()
                for _ in range(10):
                    batch.metadata.backend_data.clear()
                    backend.forward(batch.query, cache, batch.metadata, 0.125, None, batch.key, batch.value)
                times[label].append((time.perf_counter() - start) / 10)
                cpu_backend.KERNEL_MAX_QUERY_LEN = old
        figures = ", ".join(f"{label} {statistics.median(t[1:]) * 1e6:7.0f} us" for label, t in times.items())
        print(f"8 rows x q_len {q_len:>2} over 256 cached, H=12 H_kv=4 D=64 [{cpu_model_name()}, {isa}] {figures}",
              flush=True)


def main() -> None:
    global LAYERS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", choices=list(cpu_extension.ISA_FLAGS), default=None)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--mirror-commit", default="2a29042", help="'' for none")
    parser.add_argument("--prefill", action="store_true", help="also time short query rows")
    parser.add_argument("--kv-cache-dtype", default="float32",
                        help="comma-separated cache dtypes: float32, bfloat16, float16, fp8, fp8_e5m2, int8, k8v4")
    parser.add_argument("--backends", default="kernel,gather,mirror", help="comma-separated: which to time")
    parser.add_argument("--layers", type=int, default=LAYERS, help="caches attended per step")
    parser.add_argument("--smollm2", action="store_true", help="also 16 rows x ctx 1024 at H=9 H_kv=3 D=64")
    args = parser.parse_args()
    LAYERS = args.layers
    cache_dtypes = tuple(args.kv_cache_dtype.split(","))
    isa = args.isa or cpu_extension.available_isas()[0]
    op = cpu_extension.load_paged_attention(isa)
    if op is None:
        sys.exit("the compiled kernel is unavailable (see the warning above)")

    class Kernel(cpu_backend.CpuAttentionBackend):
        def __init__(self, kv_quant: KVQuantFormat | None = None) -> None:
            super().__init__(kv_quant)
            self._op = op
            self._quant_op = cpu_extension.load_attention_op("paged_attention_quant", isa)

    class Gather(TorchAttentionBackend):
        def forward(self, query, kv_cache, metadata, scale, sliding_window, key=None, value=None, **kwargs):
            return super().forward(query, kv_cache, metadata, scale, sliding_window, **kwargs)

    backends: dict[str, Callable[..., object]] = {"kernel": Kernel, "gather": Gather}
    mirror = old_mirror_backend(args.mirror_commit)
    if mirror is not None:
        backends["mirror"] = mirror
    backends = {label: make for label, make in backends.items() if label in args.backends.split(",")}
    gen = torch.Generator().manual_seed(0)
    contexts = torch.randint(128, 385, (64,), generator=gen).tolist()
    bench_decode("64 rows x ctx 128-384, H=12 H_kv=4 D=64", contexts, 12, 4, 64, 16, backends, args.reps, isa,
                 cache_dtypes)
    bench_decode("1 row x ctx 384, H=9 H_kv=3 D=64", [384], 9, 3, 64, 16, backends, args.reps, isa, cache_dtypes)
    if args.smollm2:
        bench_decode("16 rows x ctx 1024, H=9 H_kv=3 D=64", [1024] * 16, 9, 3, 64, 16, backends, args.reps, isa,
                     cache_dtypes)
    if args.prefill:
        bench_short_rows(args.reps, isa)


if __name__ == "__main__":
    main()
