"""kvtide's on-disk cache (`$KVTIDE_CACHE`, default ~/.cache/kvtide): the demo and bench checkpoints,
prepared GGUF directories and their float32 exports, built tokenizers, compiled CPU kernels and GEMM
tunings. Entries are built whole or not at all.

What kvtide reads back from here it trusts as it trusts its own install: compiled libraries are
loaded into the process, checkpoints and tokenizers decide what the model says. So the cache must be
this user's alone. Every directory kvtide creates in it is created 0700, and `cache_dir` refuses
(UnsafeCacheDirError) any level from `cache_root()` down that another user could write to: group-
or world-writable, or owned by another uid. Root too is refused a directory owned by another user:
that user could plant a library for root to load. Triton's kernel cache is held to the same rule
(check_triton_cache). The directories above `cache_root()` (~/.cache, or the volume a container
mounts at /cache) are not checked; `cache_root()` itself is what `KVTIDE_CACHE` names, so point it
at a directory of your own, or at a missing one kvtide creates.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable

PRIVATE_MODE = 0o700


class UnsafeCacheDirError(RuntimeError):
    """A cache directory another user could write to: kvtide will not load anything from it."""


def cache_root() -> str:
    """Where the cache lives; a path only (nothing created or checked: cache_dir does that)."""
    return os.path.abspath(os.environ.get("KVTIDE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvtide"))


def cache_dir(*parts: str, create: bool = True) -> str:
    """`cache_root()/parts...`, each level from the root down checked by check_private_dir and, where
    missing, created 0700 (the last level only when `create`: an entry that build_cached_dir renames
    into place is checked if it exists, never made empty)."""
    return private_cache_path(os.path.join(cache_root(), *parts), create=create)


def private_cache_path(path: str, create: bool = True) -> str:
    """cache_dir for a path already joined: every level from cache_root() down to `path` checked and
    created as cache_dir says. A path outside the cache (an export the user asked for) is returned
    unchecked: its directory is the user's choice, not kvtide's cache."""
    root, path = cache_root(), os.path.abspath(path)
    if os.path.commonpath([root, path]) != root:
        return path
    relative = os.path.relpath(path, root)
    names = [] if relative == os.curdir else relative.split(os.sep)
    levels = [root] + [os.path.join(root, *names[:i + 1]) for i in range(len(names))]
    os.makedirs(os.path.dirname(root), exist_ok=True)  # ~/.cache: not kvtide's, as the user's umask makes it
    for i, level in enumerate(levels):
        if create or i < len(levels) - 1:
            try:
                os.mkdir(level, PRIVATE_MODE)
            except FileExistsError:
                pass
        elif not os.path.lexists(level):
            break
        check_private_dir(level)
    return path


def check_private_dir(path: str) -> None:
    """Refuse `path` unless it is a directory owned by this process's user that no one else can write
    to (group- or world-writable, or another owner, is an UnsafeCacheDirError naming the fix)."""
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheDirError(f"cache path {path} is not a directory; remove it or set KVTIDE_CACHE "
                                  f"to a directory of your own")
    problems = []
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is not None and info.st_uid != uid:
        problems.append(f"owned by {_user(info.st_uid)}, not by {_user(uid)} who runs kvtide")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append("writable by " + " and ".join(
            who for bit, who in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "every user")) if info.st_mode & bit))
    if problems:
        mode = stat.S_IMODE(info.st_mode)
        raise UnsafeCacheDirError(
            f"refusing the cache directory {path} (mode {mode:04o}, owner {_user(info.st_uid)}): it is "
            f"{'; '.join(problems)}, so another user could plant a file kvtide would load (a compiled "
            f"library, a tokenizer, a checkpoint). Make it yours alone (chown {_name(uid)} {path} && "
            f"chmod 700 {path}), or set KVTIDE_CACHE to a directory of your own (kvtide "
            f"creates a missing one 0700)")


def check_triton_cache() -> str:
    """Triton's own kernel cache ($TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache, as Triton reads
    them): it loads compiled kernels from there, so it is held to the same rule, created 0700 where
    missing. Called where kvtide's Triton kernels are imported; returns the directory."""
    path = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache")
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path, PRIVATE_MODE)
        except FileExistsError:
            pass
    check_private_dir(path)
    return path


def _user(uid: int) -> str:
    name = _name(uid)
    return f"uid {uid}" if name == str(uid) else f"{name} (uid {uid})"


def _name(uid: int | None) -> str:
    """The user's name, else the uid as chown takes it."""
    if uid is None:
        return "$USER"
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def build_cached_dir(target: str, build: Callable[[str], None]) -> str:
    """`build(tmp)` fills a temporary sibling of `target` (0700), which is then renamed into place, so
    a reader never sees half an entry. When another process renamed its own first, that one is kept.
    Within the cache, the directories above `target` (and `target`, if it exists) are checked first."""
    private_cache_path(target, create=False)
    tmp = f"{target.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    os.mkdir(tmp, PRIVATE_MODE)
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
