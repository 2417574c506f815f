"""kvtide's on-disk cache (`$KVTIDE_CACHE`, default ~/.cache/kvtide): the demo and bench checkpoints,
prepared GGUF directories and their float32 exports. Entries are built whole or not at all."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable


def cache_root() -> str:
    return os.environ.get("KVTIDE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "kvtide"))


def build_cached_dir(target: str, build: Callable[[str], None]) -> str:
    """`build(tmp)` fills a temporary sibling of `target`, which is then renamed into place, so a
    reader never sees half an entry. When another process renamed its own first, that one is kept."""
    tmp = f"{target.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # target exists and is not empty: built by another process
            if not os.path.isdir(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
