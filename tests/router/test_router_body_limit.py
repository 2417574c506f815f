"""The router's request-body limit holds while the body streams in: a huge chunked body is refused
with 413 once the limit is passed, and the router's memory never holds more than the limit."""

from __future__ import annotations

import json
import select
import socket

from router_helpers import free_port, start_router

from kvtide.router.config import MAX_REQUEST_BODY

CHUNK = b"x" * (1 << 20)
BODY_BYTES = 400 * (1 << 20)


def _memory_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    return {name: int(value.split()[0]) for name, value in fields.items()}


def _send_chunked(port: int, total: int) -> tuple[bytes, int]:
    """POST a chunked body of `total` bytes, stopping as soon as an answer arrives or the router
    closes; (the answer's bytes, body bytes sent)."""
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        frame = b"%x\r\n" % len(CHUNK) + CHUNK + b"\r\n"
        try:
            while sent < total:
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    break
                sock.sendall(frame)
                sent += len(CHUNK)
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(30)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return answer, sent


def test_huge_chunked_body_is_refused_while_it_streams():
    # No backend is needed: the body is refused before any is chosen.
    router = start_router("--backends", f"http://127.0.0.1:{free_port()}", "--health-check-interval", "60")
    try:
        before = _memory_kib(router.proc.pid)
        answer, sent = _send_chunked(router.port, BODY_BYTES)
        after = _memory_kib(router.proc.pid)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), answer[:300]
        assert json.loads(body)["error"]["code"] == "body_too_large"
        assert sent < BODY_BYTES // 2, f"the router read {sent} bytes before refusing"
        grown_mib = (after["VmHWM"] - before["VmRSS"]) / 1024
        assert grown_mib < 100, f"router peak RSS grew by {grown_mib:.0f} MiB (limit {MAX_REQUEST_BODY >> 20} MiB)"
        assert router.proc.poll() is None
    finally:
        router.stop()
