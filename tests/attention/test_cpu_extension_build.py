"""The compiled ops' build directory shared between processes: a lock left by a build that was killed
does not hang later starts, and a live builder is still waited for; a build started ahead on a
thread (prebuild) is waited for by the first load."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time

from kvtide.attention import cpu_extension

LOAD = ("from kvtide.attention import cpu_extension; "
        "assert cpu_extension.load_paged_attention('default') is not None; print('loaded')")


def _start_loader() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_a_lock_left_by_a_killed_build_is_cleared_and_a_live_builder_waited_for():
    assert cpu_extension.load_paged_attention("default") is not None  # built (ninja has nothing left to do)
    directory = cpu_extension.build_directory("default")
    stale = directory / "lock"
    stale.write_text("")  # what torch's FileBaton leaves when its process is killed mid-build

    # A live kvtide builder holds the flock: a second process waits, and leaves the lock alone.
    with open(directory / "kvtide.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        loader = _start_loader()
        try:
            time.sleep(4)
            waited = loader.poll() is None
            assert stale.exists()
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    try:
        out, _ = loader.communicate(timeout=600)
    finally:
        loader.kill()
    assert waited, out
    assert loader.returncode == 0 and "loaded" in out, out
    assert not stale.exists()

    # No live builder: the lock is stale, and a start goes straight through it.
    stale.write_text("")
    loader = _start_loader()
    try:
        out, _ = loader.communicate(timeout=600)
    finally:
        loader.kill()
    assert loader.returncode == 0 and "loaded" in out, out
    assert "did not finish" in out and not stale.exists()


def test_prebuild_returns_at_once_and_the_first_load_waits_for_its_build(monkeypatch):
    assert cpu_extension.load_paged_attention("default") is not None  # built: the test only waits on the lock
    monkeypatch.setattr(cpu_extension, "_loaded", {})
    monkeypatch.setattr(cpu_extension, "_building", {})
    key = (str(cpu_extension.SOURCE), "default")
    loaded: dict = {}
    with open(cpu_extension.build_directory("default") / "kvtide.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a build in progress, as far as the prebuild can tell
        start = time.monotonic()
        cpu_extension.prebuild(cpu_extension.SOURCE, cpu_extension.LIBRARY, cpu_extension.WHAT, "default")
        assert time.monotonic() - start < 1.0
        builder = cpu_extension._building[key]
        loader = threading.Thread(target=lambda: loaded.update(op=cpu_extension.load_paged_attention("default")))
        loader.start()
        time.sleep(1.0)
        assert builder.is_alive() and loader.is_alive() and key not in cpu_extension._loaded
        cpu_extension.prebuild(cpu_extension.SOURCE, cpu_extension.LIBRARY, cpu_extension.WHAT, "default")
        assert cpu_extension._building[key] is builder  # one build per library, however often asked
        fcntl.flock(held, fcntl.LOCK_UN)
    loader.join(600)
    assert not builder.is_alive() and loaded["op"] is not None
    assert cpu_extension._loaded[key] == "kvtide_default"
