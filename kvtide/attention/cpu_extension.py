"""The compiled CPU ops, built on first use: paged attention over float and quantized caches and the
quantized K/V write (csrc/paged_attention.cpp, one library), and the quantized linears
(layers/quantization/csrc/quantized_linear.cpp).

Each source is compiled once per ISA, each build its own library and op namespace
(`torch.ops.kvtide_avx512`, `kvtide_avx2`, `kvtide_default` for attention; `kvtide_quant_<isa>`
for the linears), and the best one this CPU runs is
chosen at run time: one binary built for the machine it was compiled on would fault (or be slow) on
another, and a wheel cannot know where it will run. `torch.backends.cpu.get_cpu_capability()` says
what the CPU runs (and honours ATEN_CPU_CAPABILITY, as torch's own kernels do).

Builds go through `torch.utils.cpp_extension.load` against the installed torch (never an isolated
pip build, whose torch could differ in ABI) into `cache_root()/torch_ext/<torch>-<source>-<isa>-<hash>`, so a
new torch or a changed source gets a fresh directory. Concurrent processes share one build: each
holds an flock on `kvtide.flock` in that directory while it builds or loads, which the kernel
releases if the process dies. cpp_extension's own `lock` file is not released that way (a build
killed mid-way leaves it, and every later start would wait on it forever), so one found under the
flock, where no live kvtide process can own it, is removed. No compiler, a failed build, or KVTIDE_CPU_KERNELS=0
gives None (with one warning), and the callers fall back to pure torch. A build directory another user
could write to (a library planted there would be loaded into this process) is refused before anything
is built or loaded from it: an UnsafeCacheDirError (models/cache_dir.py), never a silent fallback.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvtide.models.cache_dir import UnsafeCacheDirError, cache_root, private_cache_path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
LIBRARY, WHAT = "kvtide", "compiled CPU attention"
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
    "default": ["-DCPU_CAPABILITY_DEFAULT", "-DCPU_CAPABILITY=DEFAULT"],
}
"""Best first. Each build also gets its own op namespace (KVTIDE_OPS_NS)."""
COMMON_FLAGS = ["-O3", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
"""-fopenmp: at::parallel_for is inlined and runs serially without it (the library then shares
torch's libgomp, loaded first under the same soname). Hidden visibility: the builds share inline
functions (at::vec, c10) compiled for different ISAs, which must not interpose one another."""

_loaded: dict[tuple[str, str], str | None] = {}
"""(source, isa) -> the op namespace of its build, or None (no build)."""
_building: dict[tuple[str, str], threading.Thread] = {}
"""Builds prebuild started; load_cpu_op joins one before it looks in _loaded."""
_warned: set[str] = set()


def available_isas() -> list[str]:
    """The ISAs of ISA_FLAGS this CPU runs, best first (what get_cpu_capability allows)."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    names = list(ISA_FLAGS)
    if capability in names:
        return names[names.index(capability):]
    return ["default"]


def load_paged_attention(isa: str | None = None) -> Callable | None:
    """`torch.ops.kvtide_<isa>.paged_attention` for `isa` (default: the best this CPU runs), built
    if needed; None where it cannot be (the reason logged once). Cached per process."""
    return load_attention_op("paged_attention", isa)


def load_attention_op(op: str, isa: str | None = None) -> Callable | None:
    """One op of csrc/paged_attention.cpp's library: paged_attention, paged_attention_quant or
    write_kv_quant (all from the same build), as load_paged_attention."""
    return load_cpu_op(SOURCE, LIBRARY, op, WHAT, isa)


def prebuild_attention() -> None:
    """The attention library's build for this CPU, started on a thread (prebuild)."""
    prebuild(SOURCE, LIBRARY, WHAT)


def load_cpu_op(source: Path, library: str, op: str, what: str, isa: str | None = None) -> Callable | None:
    """`torch.ops.<library>_<isa>.<op>` from the C++ file `source` (which registers its ops under
    the KVTIDE_OPS_NS macro), built for `isa` if needed; None where it cannot be (no compiler, a
    failed build, KVTIDE_CPU_KERNELS=0; the reason logged once, naming `what`)."""
    if os.environ.get("KVTIDE_CPU_KERNELS", "1") == "0":
        _warn_once(f"KVTIDE_CPU_KERNELS=0: {what} disabled, using pure torch")
        return None
    isa = isa or available_isas()[0]
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be one of {', '.join(ISA_FLAGS)}; got {isa!r}")
    key = (str(source), isa)
    started = _building.get(key)
    if started is not None:
        started.join()
    if key not in _loaded:
        _loaded[key] = _build(source, library, isa, what)
    namespace = _loaded[key]
    return None if namespace is None else getattr(getattr(torch.ops, namespace), op)


def prebuild(source: Path, library: str, what: str, isa: str | None = None) -> None:
    """Start `source`'s build for `isa` (as load_cpu_op would make it) on a thread, and return.
    On a cold cache each build is a compiler process of 6-15 s: started together before the model
    loads, they run side by side and under the weights' loading instead of one after another at
    first use. The first load_cpu_op of that build waits for it; on a warm cache it only loads."""
    if os.environ.get("KVTIDE_CPU_KERNELS", "1") == "0":
        return
    isa = isa or available_isas()[0]
    key = (str(source), isa)
    if key in _loaded or key in _building:
        return

    def build() -> None:
        with contextlib.suppress(UnsafeCacheDirError):  # load_cpu_op builds again and raises it to its caller
            _loaded[key] = _build(source, library, isa, what)

    thread = _building[key] = threading.Thread(target=build, name=f"kvtide-build-{source.stem}", daemon=True)
    thread.start()


def build_directory(isa: str, source: Path = SOURCE) -> Path:
    """Where `isa`'s build of `source` lives: one directory per torch version, ISA, source + flags and
    checkout (ninja rebuilds when a compile command's source path changes, so two checkouts sharing a
    directory would rebuild each other's library at every switch)."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join(ISA_FLAGS[isa] + COMMON_FLAGS).encode())
    digest.update(str(source.resolve()).encode())
    return Path(cache_root()) / "torch_ext" / f"{torch.__version__}-{source.stem}-{isa}-{digest.hexdigest()[:12]}"


def _build(source: Path, library: str, isa: str, what: str) -> str | None:
    """The op namespace of `source`'s build for `isa`, or None (the reason logged once); an unsafe
    build directory is an UnsafeCacheDirError."""
    namespace = f"{library}_{isa}"
    try:
        from torch.utils import cpp_extension

        directory = Path(private_cache_path(str(build_directory(isa, source))))  # created 0700, or refused
        with _exclusive_build(directory):
            cpp_extension.load(
                name=f"{library}_{source.stem}_{isa}", sources=[str(source)],
                extra_cflags=COMMON_FLAGS + ISA_FLAGS[isa] + [f"-DKVTIDE_OPS_NS={namespace}"],
                extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
                verbose=False)
        return namespace
    except UnsafeCacheDirError:
        raise
    except Exception as e:  # no compiler, no ninja, a failed build: fall back, but say why
        _warn_once(f"{what} ({isa}) unavailable, using pure torch: "
                   f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
        return None


@contextlib.contextmanager
def _exclusive_build(directory: Path) -> Iterator[None]:
    """Holds `directory`'s flock (waiting for a live builder), then clears a stale cpp_extension lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX: cpp_extension's lock alone
        yield
        return
    with open(directory / "kvtide.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield  # closing the file releases the flock


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
