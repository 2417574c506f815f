"""Start, probe and stop real `kvtide serve` subprocesses (127.0.0.1, a free port, a tiny model)."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

API_KEY = "test-key-123"
ADMIN_KEY = "test-admin-key-456"
"""--admin-api-key of servers started without an API key (with one, the admin key is the API key,
so that tests call /internal/* with the headers they use for everything else)."""
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 1024
MAX_REQUEST_BODY = 64 * 1024
STARTUP_TIMEOUT_S = 240.0


@functools.cache
def log_dir() -> str:
    """One folder for this test process's server logs, removed when it exits: tests read a log
    after its server stops, so no single test can delete it."""
    path = tempfile.mkdtemp(prefix="kvtide-serve-logs-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    port: int
    api_key: str | None
    log_path: str
    engine_pid: int | None = None
    admin_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def admin_headers(self) -> dict[str, str]:
        """For /internal/* (and the admin routes): the admin key."""
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def url(self, path: str) -> str:
        return self.base_url + path

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=kwargs.pop("timeout", 60.0),
                            **kwargs)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stats(self) -> dict:
        r = httpx.get(self.url("/internal/stats"), headers=self.admin_headers, timeout=30.0)
        r.raise_for_status()
        return r.json()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.engine_pid is not None and pid_alive(self.engine_pid):
            os.kill(self.engine_pid, signal.SIGKILL)
        return self.proc.returncode


def launch_server(model: str, *extra_args: str, api_key: str | None = API_KEY) -> ServerHandle:
    """Start a server and wait until /health answers 200."""
    return wait_ready(start_server(model, *extra_args, api_key=api_key))


def start_server(model: str, *extra_args: str, api_key: str | None = API_KEY, env: dict[str, str] | None = None,
                 log_level: str = "INFO", admin_key: str | None = "") -> ServerHandle:
    """Start a server process without waiting (start several, then wait_ready each: they load in
    parallel). `env` adds variables (e.g. KVTIDE_FAULT_INJECT, which is otherwise never inherited).
    `admin_key`: --admin-api-key (default: the API key, else ADMIN_KEY; None: no admin key, so no
    /internal/* and no engine pid known)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="kvtide-serve-", suffix=".log", dir=log_dir(), delete=False)
    args = [sys.executable, "-m", "kvtide.cli", "serve", model, "--port", str(port),
            "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
            "--max-request-body", str(MAX_REQUEST_BODY), *extra_args]
    if api_key:
        args += ["--api-key", api_key]
    if admin_key == "":
        admin_key = api_key or ADMIN_KEY
    if admin_key:
        args += ["--admin-api-key", admin_key]
    # One thread per process: the test machine's cores are shared.
    full_env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", KVTIDE_LOG_LEVEL=log_level)
    full_env.pop("KVTIDE_API_KEY", None)
    full_env.pop("KVTIDE_ADMIN_API_KEY", None)
    full_env.pop("KVTIDE_FAULT_INJECT", None)
    full_env.update(env or {})
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env)
    log.close()
    return ServerHandle(proc, port, api_key, log.name, admin_key=admin_key)


def wait_ready(handle: ServerHandle) -> ServerHandle:
    try:
        _wait_healthy(handle)
        if handle.admin_key:
            handle.engine_pid = handle.stats()["engine_core_pid"]
    except BaseException:
        handle.stop()
        print(handle.log()[-5000:])
        raise
    return handle


def _wait_healthy(handle: ServerHandle) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if handle.proc.poll() is not None:
            raise RuntimeError(f"server exited with {handle.proc.returncode} during startup")
        try:
            if httpx.get(handle.url("/health"), timeout=5.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s")


def wait_idle(server: ServerHandle, timeout_s: float = 20.0) -> dict:
    """Stats once nothing runs or waits in the engine (fails after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    stats = server.stats()
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_unfinished_requests"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"engine still busy after {timeout_s} s: {stats}")


def sse_events(lines) -> list:
    """`data:` lines of an SSE stream -> parsed JSON events, the final "[DONE]" kept as the string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
