"""Helpers of the reliability suite: servers with extra environment, SSE reading, process facts
(RSS, children) and the figures printed at the end of the run.

The `kvtide serve` launcher and probes are tests/server/serve_helpers.py's, reused as they are.
"""

from __future__ import annotations

import os
import time
from typing import Any

from serve_helpers import (
    API_KEY,
    MAX_MODEL_LEN,
    MAX_REQUEST_BODY,
    MODEL_NAME,
    ServerHandle,
    free_port,
    pid_alive,
    sse_events,
    start_server,
    wait_idle,
    wait_ready,
)

__all__ = ["API_KEY", "MAX_MODEL_LEN", "MAX_REQUEST_BODY", "MODEL_NAME", "ServerHandle", "free_port", "pid_alive",
           "wait_idle", "wait_ready", "FIGURES", "start", "rss_kib", "children_of", "check_error_body",
           "sse_events", "wait_for", "bytes_per_block", "FUZZ_VOCAB", "LOAD_KV_BLOCKS", "NAN_TOKEN", "RAISE_TOKEN"]

FUZZ_VOCAB = 512
"""vocab_size of fuzz_server's checkpoint (the byte tokenizer uses 259 ids; 300 logit_bias keys fit)."""
LOAD_KV_BLOCKS = 64
"""KV blocks of load_server: 32 clients need many times more, so the scheduler preempts."""
NAN_TOKEN, RAISE_TOKEN = 257, 258
"""fault_server: a prompt holding NAN_TOKEN gets NaN logits, one holding RAISE_TOKEN raises."""

FIGURES: dict[str, Any] = {}
"""Figures the tests record (printed by conftest's terminal summary, one JSON line each)."""


def start(model: str, *extra_args: str, env: dict[str, str] | None = None,
          api_key: str | None = API_KEY) -> ServerHandle:
    """serve_helpers.start_server with extra environment variables (e.g. KVTIDE_FAULT_INJECT) and
    warnings-only logs (the load run would write a line per request)."""
    return start_server(model, *extra_args, api_key=api_key, env=env, log_level="WARNING")


def bytes_per_block(block_size: int = 16, layers: int = 4, kv_heads: int = 2, head_dim: int = 32) -> int:
    """KV bytes of one block of the default tiny Llama in float32 (K and V)."""
    return 2 * block_size * kv_heads * head_dim * 4 * layers


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def check_error_body(body: Any) -> dict:
    """OpenAI's error object: {"error": {"message": str, "type": str, "param": ..., "code": ...}}."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


ANTHROPIC_PATHS = ("/v1/messages",)
"""Routes that answer in Anthropic's error shape (the Messages API), not OpenAI's."""


def check_error_body_for(path: str, body: Any) -> dict:
    """The error object a route owes: Anthropic's {"type": "error", "error": {"type", "message"}} on
    the Messages API, OpenAI's everywhere else."""
    if not path.startswith(ANTHROPIC_PATHS):
        return check_error_body(body)
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"type", "message"}, error
    assert isinstance(error["type"], str) and error["type"], error
    assert isinstance(error["message"], str) and error["message"], error
    return error


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.02) -> float:
    """Poll until predicate() is true; returns the seconds it took (AssertionError after timeout_s)."""
    start_t = time.monotonic()
    while time.monotonic() - start_t < timeout_s:
        try:
            if predicate():
                return time.monotonic() - start_t
        except Exception:  # e.g. a connection refused while the server goes away
            pass
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
