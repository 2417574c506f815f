"""Batch jobs inside the server: an uploaded file's lines go through the server's own routes (in
process, kvtide/batch/runner.py), beside interactive traffic but behind it.

How a batch yields to interactive requests:
- every line is submitted with engine priority BATCH_PRIORITY (interactive requests default to 0).
  Under `--scheduling-policy priority` the scheduler admits waiting requests lowest value first, so
  a waiting interactive request is admitted before any waiting batch line, and when the KV pool runs
  short the running request preempted first is a batch line;
- at most --max-batch-concurrency lines (all batches together) are in the engine at once, so
  batch lines never fill every running slot (--max-num-seqs) or the waiting queue.
Under `--scheduling-policy fcfs` (the default) the priority is ignored: batch lines then queue in
arrival order with interactive requests, and only the concurrency cap holds them back; serve with
`--scheduling-policy priority` where batches share the server with latency-sensitive traffic.

Batch lines skip the HTTP middleware (API-key quotas, the in-flight count a drain waits for): the
batch was admitted when it was created. Successful lines go to the batch's output file, the others
to its error file, in input order; request_counts follow as lines finish.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from kvtide.batch.file_format import (
    BATCH_URLS,
    EMBEDDINGS_URL,
    NO_EMBEDDINGS,
    dump_record,
    is_success,
    read_lines,
)
from kvtide.batch.runner import BATCH_PRIORITY, BatchRunner
from kvtide.batch.store import (
    OUTPUT_PURPOSE,
    UPLOAD_PURPOSE,
    BatchStore,
    FileStore,
    StoreError,
    StoreLock,
    default_directory,
)
from kvtide.server.errors import OpenAIError
from kvtide.server.openai.batches.settings import BatchSettings

COMPLETION_WINDOW = "24h"
"""The only completion window OpenAI offers (kvtide runs a batch at once and never expires it)."""
SAVE_INTERVAL_S = 1.0
"""A running batch's record (request_counts) is rewritten at most this often."""


def store_error(e: StoreError) -> OpenAIError:
    return OpenAIError(e.message, e.status, param=e.param, code=e.code)


class BatchService:
    """The file and batch stores of one server, and the batches running in it. `app` serves the
    OpenAI routes the lines go to (the FastAPI app without its middleware)."""

    def __init__(self, app: Any, settings: BatchSettings) -> None:
        directory = settings.directory or default_directory()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        try:
            self._lock = StoreLock(directory)
        except StoreError as e:
            raise store_error(e) from None
        self.app = app
        self.settings = settings
        self.files = FileStore(directory, settings.max_file_bytes, settings.max_file_lines)
        self.batches = BatchStore(directory)
        self._semaphore = asyncio.Semaphore(settings.max_concurrency)
        self._runners: dict[str, BatchRunner] = {}
        self._tasks: set[asyncio.Task] = set()

    # ---- batches ------------------------------------------------------------------------
    async def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                           metadata: dict[str, str] | None) -> dict[str, Any]:
        if endpoint not in BATCH_URLS:
            raise OpenAIError(f"endpoint must be one of {', '.join(BATCH_URLS)}, got {endpoint!r}", 400,
                              param="endpoint")
        if endpoint == EMBEDDINGS_URL:
            raise OpenAIError(NO_EMBEDDINGS, 400, param="endpoint", code="model_not_supported")
        if completion_window != COMPLETION_WINDOW:
            raise OpenAIError(f"completion_window must be {COMPLETION_WINDOW!r}, got {completion_window!r}", 400,
                              param="completion_window")
        try:
            input_file = self.files.get(input_file_id)
            input_path = self.files.content_path(input_file_id)
        except StoreError as e:
            raise store_error(e) from None
        if input_file.purpose != UPLOAD_PURPOSE:
            raise OpenAIError(f"input_file_id: {input_file_id} has purpose {input_file.purpose!r}, not "
                              f"{UPLOAD_PURPOSE!r}", 400, param="input_file_id")
        num_lines = await asyncio.to_thread(_count_lines, input_path)  # up to --max-batch-file-bytes of it
        now = int(time.time())
        batch: dict[str, Any] = {
            "id": self.batches.new_id(), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": num_lines, "completed": 0, "failed": 0},
            "metadata": metadata}
        self.batches.save(batch)
        runner = BatchRunner(self.app, self.settings.max_concurrency, BATCH_PRIORITY, self._semaphore)
        self._runners[batch["id"]] = runner
        task = asyncio.get_running_loop().create_task(self._run(batch, runner, input_path))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return batch

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        try:
            return self.batches.get(batch_id)
        except StoreError as e:
            raise store_error(e) from None

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        batch = self.get_batch(batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if batch["status"] not in ("validating", "in_progress"):
            raise OpenAIError(f"batch {batch_id} is {batch['status']}: only a running batch can be cancelled", 409,
                              param="batch_id", code="batch_not_running")
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        self.batches.save(batch)
        runner = self._runners.get(batch_id)
        if runner is not None:
            runner.cancel()
        return batch

    async def _run(self, batch: dict[str, Any], runner: BatchRunner, input_path: str) -> None:
        if batch["status"] == "validating":
            batch.update(status="in_progress", in_progress_at=int(time.time()))
            self.batches.save(batch)
        counts = batch["request_counts"]
        paths = {True: self.files.new_path(), False: self.files.new_path()}
        last_save = time.monotonic()
        try:
            with open(paths[True], "wb") as out, open(paths[False], "wb") as err:
                def emit(record: dict[str, Any]) -> None:
                    nonlocal last_save
                    ok = is_success(record)
                    (out if ok else err).write(dump_record(record))
                    counts["completed" if ok else "failed"] += 1
                    if time.monotonic() - last_save > SAVE_INTERVAL_S:
                        out.flush()
                        err.flush()
                        self.batches.save(batch)
                        last_save = time.monotonic()

                await runner.run(read_lines(input_path, batch["endpoint"]), emit)
            batch.update(status="finalizing", finalizing_at=int(time.time()))
            for ok, key, suffix in ((True, "output_file_id", "output"), (False, "error_file_id", "error")):
                if counts["completed" if ok else "failed"]:
                    batch[key] = self.files.adopt(paths.pop(ok), f"{batch['id']}_{suffix}.jsonl", OUTPUT_PURPOSE).id
            if batch["cancelling_at"] is not None:
                batch.update(status="cancelled", cancelled_at=int(time.time()))
            else:
                batch.update(status="completed", completed_at=int(time.time()))
        except Exception as e:
            batch.update(status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [
                {"code": "internal_error", "message": f"the batch failed: {type(e).__name__}: {e}",
                 "param": None, "line": None}]})
        finally:
            for path in paths.values():
                if os.path.exists(path):
                    os.unlink(path)
            self._runners.pop(batch["id"], None)
            self.batches.save(batch)

    def list_batches(self, after: str | None, limit: int) -> dict[str, Any]:
        batches = self.batches.list()
        if after is not None:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        page = batches[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit}

    # ---- files ---------------------------------------------------------------------------
    async def upload(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        try:
            record = await asyncio.to_thread(self.files.create, data, filename, purpose)
        except StoreError as e:
            raise store_error(e) from None
        return record.as_dict()

    def file(self, file_id: str) -> dict[str, Any]:
        try:
            return self.files.get(file_id).as_dict()
        except StoreError as e:
            raise store_error(e) from None

    def file_path(self, file_id: str) -> str:
        try:
            return self.files.content_path(file_id)
        except StoreError as e:
            raise store_error(e) from None

    def delete_file(self, file_id: str) -> dict[str, Any]:
        try:
            record = self.files.delete(file_id)
        except StoreError as e:
            raise store_error(e) from None
        return {"id": record.id, "object": "file", "deleted": True}

    def list_files(self, purpose: str | None) -> dict[str, Any]:
        return {"object": "list", "data": [r.as_dict() for r in self.files.list(purpose)], "has_more": False}


def _count_lines(path: str) -> int:
    """The requests in a batch input file: its non-blank lines."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())
