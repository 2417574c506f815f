"""Uploaded files and batch records on disk, for the server's /v1/files and /v1/batches.

    <directory>/files/file-<hex>.jsonl     the file's bytes
    <directory>/files/file-<hex>.json      its OpenAI file object (id, bytes, filename, purpose, ...)
    <directory>/batches/batch_<hex>.json   a batch object, rewritten as the batch advances

The directory is this user's alone (0700, files 0600): batch inputs and outputs are prompts and
answers. Every write goes to a temporary name first and is renamed into place, so a reader never
sees half a record. Ids are checked against their pattern before any path is built from them.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from kvtide.models.cache_dir import cache_dir

UPLOAD_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
_FILE_ID = re.compile(r"file-[0-9a-f]{24}")
_BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")


class StoreError(Exception):
    """A request the store refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


def default_directory() -> str:
    """The store under kvtide's private cache directory ($KVTIDE_CACHE/batches)."""
    return cache_dir("batches")


class StoreLock:
    """This process's claim on a store directory (an exclusive flock on <directory>/lock, held
    until the process exits): a second server on the same directory would fail the first one's
    running batches when it loads them, and index files it never sees."""

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, "lock")
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise StoreError(f"the batch directory {directory} is in use by another kvtide process (pid {owner}); "
                             f"give each server its own --batch-dir", 503, code="batch_dir_in_use") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)


def _private_dir(path: str) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _write_json(path: str, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


class FileStore:
    """Batch input files (uploads, within the size and line limits) and batch outputs."""

    def __init__(self, directory: str, max_bytes: int, max_lines: int) -> None:
        self.directory = _private_dir(os.path.join(directory, "files"))
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self._records: dict[str, FileRecord] = {}
        for name in os.listdir(self.directory):
            if name.startswith((".new-", ".tmp-")):  # left by a server that stopped mid-write
                os.unlink(os.path.join(self.directory, name))
                continue
            stem, ext = os.path.splitext(name)
            if ext == ".json" and _FILE_ID.fullmatch(stem) and os.path.exists(self._data_path(stem)):
                with open(os.path.join(self.directory, name), encoding="utf-8") as f:
                    item = json.load(f)
                self._records[stem] = FileRecord(stem, item["bytes"], item["created_at"], item["filename"],
                                                 item["purpose"])

    def _data_path(self, file_id: str) -> str:
        return os.path.join(self.directory, file_id + ".jsonl")

    def create(self, data: bytes, filename: str, purpose: str) -> FileRecord:
        """An upload: purpose must be "batch", the size and line count within the limits, the text UTF-8."""
        if purpose != UPLOAD_PURPOSE:
            raise StoreError(f"purpose: this server accepts files with purpose {UPLOAD_PURPOSE!r} only, got "
                             f"{purpose!r}", 400, param="purpose")
        if len(data) > self.max_bytes:
            raise StoreError(f"file: {len(data)} bytes, over this server's limit of {self.max_bytes} "
                             f"(--max-batch-file-bytes)", 400, param="file", code="file_too_large")
        if not data.strip():
            raise StoreError("file: empty", 400, param="file")
        num_lines = sum(1 for line in data.splitlines() if line.strip())
        if num_lines > self.max_lines:
            raise StoreError(f"file: {num_lines} lines, over this server's limit of {self.max_lines} "
                             f"(--max-batch-file-lines)", 400, param="file", code="file_too_large")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise StoreError(f"file: not UTF-8 text ({e})", 400, param="file") from None
        path = self.new_path()
        with open(path, "wb") as f:
            f.write(data)
        return self.adopt(path, filename, purpose)

    def new_path(self) -> str:
        """A fresh private path in the store, for a file written before adopt() registers it."""
        fd, path = tempfile.mkstemp(prefix=".new-", suffix=".jsonl", dir=self.directory)
        os.close(fd)
        return path

    def adopt(self, path: str, filename: str, purpose: str) -> FileRecord:
        """Register the file at `path` (from new_path) under a new id."""
        file_id = f"file-{secrets.token_hex(12)}"
        os.replace(path, self._data_path(file_id))
        record = FileRecord(file_id, os.path.getsize(self._data_path(file_id)), int(time.time()),
                            os.path.basename(filename) or "upload.jsonl", purpose)
        _write_json(os.path.join(self.directory, file_id + ".json"), record.as_dict())
        self._records[file_id] = record
        return record

    def get(self, file_id: str) -> FileRecord:
        record = self._records.get(file_id) if _FILE_ID.fullmatch(file_id) else None
        if record is None:
            raise StoreError(f"No such File object: {file_id}", 404, param="file_id", code="file_not_found")
        return record

    def content_path(self, file_id: str) -> str:
        return self._data_path(self.get(file_id).id)

    def delete(self, file_id: str) -> FileRecord:
        record = self.get(file_id)
        del self._records[file_id]
        for path in (os.path.join(self.directory, file_id + ".json"), self._data_path(file_id)):
            if os.path.exists(path):
                os.unlink(path)
        return record

    def list(self, purpose: str | None = None) -> list[FileRecord]:
        records = [r for r in self._records.values() if purpose is None or r.purpose == purpose]
        return sorted(records, key=lambda r: (r.created_at, r.id))


ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


class BatchStore:
    """Batch objects by id, kept in memory and on disk. A batch that was running when the server
    stopped is failed on load (its lines are not rerun: a new batch of the same file reruns them)."""

    def __init__(self, directory: str) -> None:
        self.directory = _private_dir(os.path.join(directory, "batches"))
        self._batches: dict[str, dict[str, Any]] = {}
        for name in os.listdir(self.directory):
            stem, ext = os.path.splitext(name)
            if ext == ".json" and _BATCH_ID.fullmatch(stem):
                with open(os.path.join(self.directory, name), encoding="utf-8") as f:
                    batch = json.load(f)
                if batch.get("status") in ACTIVE_STATUSES:
                    cancelling = batch["status"] == "cancelling"
                    batch["status"] = "cancelled" if cancelling else "failed"
                    batch["cancelled_at" if cancelling else "failed_at"] = int(time.time())
                    if not cancelling:
                        batch["errors"] = {"object": "list", "data": [{
                            "code": "server_stopped", "message": "the server stopped while this batch ran",
                            "param": None, "line": None}]}
                    _write_json(os.path.join(self.directory, name), batch)
                self._batches[stem] = batch

    @staticmethod
    def new_id() -> str:
        return f"batch_{secrets.token_hex(12)}"

    def save(self, batch: dict[str, Any]) -> None:
        assert _BATCH_ID.fullmatch(batch["id"])
        self._batches[batch["id"]] = batch
        _write_json(os.path.join(self.directory, batch["id"] + ".json"), batch)

    def get(self, batch_id: str) -> dict[str, Any]:
        batch = self._batches.get(batch_id) if _BATCH_ID.fullmatch(batch_id) else None
        if batch is None:
            raise StoreError(f"No such Batch object: {batch_id}", 404, param="batch_id", code="batch_not_found")
        return batch

    def list(self) -> list[dict[str, Any]]:
        """Newest first, as OpenAI lists them."""
        return sorted(self._batches.values(), key=lambda b: (b["created_at"], b["id"]), reverse=True)
