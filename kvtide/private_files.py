"""Files and sockets only this user can reach, for the processes kvtide starts.

- `private_dir`: a fresh 0700 directory (tempfile.mkdtemp) for IPC sockets. A shared /tmp with
  predictable socket names lets another local user connect first or squat on a name; inside a
  directory only we can enter, nobody else can reach the sockets at all.
- `write_args_file` / `read_args_file`: a child's arguments that may hold secrets (EngineArgs
  carries kv_transfer_config's kv_secret or a Redis password) go through a 0600 JSON file that the
  child reads and deletes at start, never its command line, which any local user reads in `ps`
  or /proc/PID/cmdline.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any


def private_dir(prefix: str = "kvtide-") -> str:
    """A new directory only this user may enter (0700), in the system's temporary directory."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o700)  # mkdtemp already does; a umask cannot loosen an explicit chmod
    return path


def remove_private_dir(path: str | None) -> None:
    """Remove a directory made by private_dir and what is left in it (sockets, unread files)."""
    if path:
        shutil.rmtree(path, ignore_errors=True)


def write_args_file(data: Any, directory: str | None = None, prefix: str = "args-") -> str:
    """`data` as JSON in a new 0600 file (in `directory`, else the temporary directory); its path."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)
            json.dump(data, f)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return path


def read_args_file(path: str) -> Any:
    """The JSON that write_args_file wrote, deleting the file (it is read once, by one child)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
