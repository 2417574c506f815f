"""Start, probe and stop a real `kvtide router` subprocess on a free 127.0.0.1 port, in front of
real `kvtide serve` backends started by tests/server/serve_helpers.py (reused as it is)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
from serve_helpers import (
    MODEL_NAME,
    ServerHandle,
    free_port,
    pid_alive,
    sse_events,
    start_server,
    wait_idle,
    wait_ready,
)

__all__ = ["MODEL_NAME", "ServerHandle", "free_port", "pid_alive", "sse_events", "start_server", "wait_idle",
           "wait_ready", "RouterHandle", "start_router", "metric_value", "kill_server", "BACKEND_FLAGS"]

BACKEND_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "8", "--kv-cache-memory", "8MiB"]
"""Small backends: the test machine has two cores and several of these run at once."""
ROUTER_STARTUP_TIMEOUT_S = 60.0


@dataclass
class RouterHandle:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metrics(self) -> str:
        return httpx.get(self.url("/metrics"), timeout=10.0).text

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log_path)
        return self.proc.returncode


def start_router(*args: str) -> RouterHandle:
    """`python -m kvtide.cli router ARGS --port FREE`, waited for until its /health answers
    (200 or 503: the router is up either way)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="kvtide-router-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "kvtide.cli", "router", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    handle = RouterHandle(proc, port, log.name)
    deadline = time.monotonic() + ROUTER_STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = handle.log()
            handle.stop()
            raise RuntimeError(f"router exited with {proc.returncode}:\n{text[-3000:]}")
        try:
            httpx.get(handle.url("/health"), timeout=5.0)
            return handle
        except httpx.TransportError:
            time.sleep(0.1)
    handle.stop()
    raise RuntimeError("router did not start")


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def kill_server(handle: ServerHandle) -> None:
    """SIGKILL the server and its engine core (the whole of what `kvtide serve` started)."""
    for pid in (handle.proc.pid, handle.engine_pid):
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    handle.proc.wait(10)
