"""Run batch lines through the server's own routes, in this process, many at once.

Each line becomes a POST to the FastAPI app over ASGI (no socket): the route validates the body,
renders and tokenizes the prompt and builds the answer exactly as for an HTTP client, so a line's
result (and its error message) is the one the server would give. Up to `max_concurrency` lines are
in the engine at once, where they batch like any concurrent requests.

Results come out in input order (a finished line waits for those before it): an output file then
always holds the results of a prefix of the input, which is what makes `--resume` exact.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvtide.batch.file_format import BatchLine, LineError, duplicate_error, error_record, result_record

BATCH_PRIORITY = 1_000_000
"""The engine priority of a /v1/batches line: under --scheduling-policy priority, lower values go
first, and interactive requests default to 0."""
RETRYABLE = frozenset({(429, "queue_full"), (503, "timeout")})
"""(status, error code) of answers that say "busy, try again" (the engine's waiting queue is full,
the tokenizer is backed up): a batch line is retried rather than failed."""
RETRY_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 4.0)
"""Waits before each retry of a busy answer; the last busy answer is the line's result."""


@dataclass
class BatchCounts:
    """OpenAI's request_counts: lines answered, successfully or not (skipped lines not counted)."""

    total: int = 0
    completed: int = 0
    failed: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}


class BatchRunner:
    """Runs lines through `app` (an ASGI app serving the OpenAI routes). `priority`, when set,
    replaces each body's priority. `semaphore` caps the lines in flight, shareable between runners."""

    def __init__(self, app: Any, max_concurrency: int = 64, priority: int | None = None,
                 semaphore: asyncio.Semaphore | None = None) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.app = app
        self.max_concurrency = max_concurrency
        self.priority = priority
        self.semaphore = semaphore or asyncio.Semaphore(max_concurrency)
        self._cancelled = False
        self._pending: collections.deque[asyncio.Future] = collections.deque()

    def cancel(self) -> None:
        """Start no more lines and abort those in flight; run() returns what finished before."""
        self._cancelled = True
        for future in self._pending:
            future.cancel()

    async def run(self, lines: Iterable[BatchLine], emit: Callable[[dict[str, Any]], None],
                  already_done: collections.Counter | None = None) -> BatchCounts:
        """Answer every line, calling emit(record) in input order. already_done: how many output
        records each custom_id (None for lines without one) already has; that many of its lines
        are skipped, as a resumed run must."""
        skip = collections.Counter(already_done or {})
        seen: set[str] = set()
        counts = BatchCounts()
        window = max(2 * self.max_concurrency, 64)
        pending = self._pending

        def flush() -> None:
            while pending and pending[0].done():
                future = pending.popleft()
                if future.cancelled():
                    continue
                record = future.result()
                counts.total += 1
                if record["error"] is None:
                    counts.completed += 1
                else:
                    counts.failed += 1
                emit(record)

        try:
            for line in lines:
                if self._cancelled:
                    break
                if skip[line.custom_id] > 0:
                    skip[line.custom_id] -= 1
                    if line.custom_id is not None:
                        seen.add(line.custom_id)
                    continue
                error = line.error
                if error is None and line.custom_id in seen:
                    error = duplicate_error(line.custom_id or "")
                if line.custom_id is not None:
                    seen.add(line.custom_id)
                while len(pending) >= window and not self._cancelled:
                    await asyncio.wait([pending[0]])
                    flush()
                if error is not None:
                    done: asyncio.Future = asyncio.get_running_loop().create_future()
                    done.set_result(error_record(line.custom_id, error))
                    pending.append(done)
                else:
                    await self.semaphore.acquire()
                    if self._cancelled:
                        self.semaphore.release()
                        break
                    task = asyncio.ensure_future(self._answer(line))
                    # Released however the task ends: one cancelled before it started runs no finally.
                    task.add_done_callback(lambda _: self.semaphore.release())
                    pending.append(task)
                flush()
            while pending:
                await asyncio.wait([pending[0]])
                flush()
        finally:
            for future in pending:
                future.cancel()
        return counts

    async def _answer(self, line: BatchLine) -> dict[str, Any]:
        assert line.url is not None and line.body is not None
        body = line.body if self.priority is None else {**line.body, "priority": self.priority}
        payload = json.dumps(body).encode("utf-8")
        for delay in (*RETRY_DELAYS_S, None):
            try:
                status, raw = await call_route(self.app, line.url, payload)
            except Exception as e:  # a route that raised past its error handlers: this line fails alone
                return error_record(line.custom_id, LineError("internal_error",
                                                              f"internal error: {type(e).__name__}", 500))
            try:
                answer = json.loads(raw) if raw else {}
            except ValueError:
                return error_record(line.custom_id, LineError("invalid_response", raw.decode("utf-8", "replace"),
                                                              status))
            if delay is None or (status, _error_code(answer)) not in RETRYABLE:
                break
            await asyncio.sleep(delay)
        return result_record(line.custom_id, status, answer)


def _error_code(answer: Any) -> str | None:
    error = answer.get("error") if isinstance(answer, dict) else None
    return error.get("code") if isinstance(error, dict) else None


async def call_route(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` (JSON) to `path` of ASGI `app` in this process -> (status, response body)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    answered = asyncio.Event()
    body_sent = False
    status = 500
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()  # the "client" stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    try:
        await app(scope, receive, send)
    finally:
        answered.set()
    return status, b"".join(chunks)
