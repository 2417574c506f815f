"""OpenAI's batch file format: one request a line in, one result a line out.

    in:  {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    out: {"id": "batch_req_...", "custom_id": "q1",
          "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}}, "error": null}

A line the server answered with an error keeps that answer in `response` (its status and the
server's error object as the body) and also names it in `error` ({"code", "message"}), so a reader
can check `error` alone. A line that never reached a route (not JSON, no custom_id, an unknown url,
a repeated custom_id) has `response: null` and only `error`.
"""

from __future__ import annotations

import collections
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
BATCH_URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
"""The urls a batch line may name (OpenAI's batch endpoints that kvtide knows)."""
GENERATION_URLS = (CHAT_URL, COMPLETIONS_URL)
"""The urls this engine answers: a generative model serves no embeddings."""
NO_EMBEDDINGS = "this model does not serve embeddings"


@dataclass(frozen=True)
class LineError:
    """Why a line has no successful answer: `status` is the HTTP status the server gave (None
    for a line refused before it reached a route)."""

    code: str
    message: str
    status: int | None = None


@dataclass
class BatchLine:
    """One input line, parsed; `error` is set when it cannot be sent at all."""

    line_no: int
    """1-based line number in the input file (blank lines count)."""
    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: LineError | None = None


def parse_line(text: str | bytes, line_no: int, endpoint: str | None = None) -> BatchLine:
    """A line of a batch input file -> BatchLine (never raises). `endpoint`: the one url every
    line must name (a /v1/batches job's endpoint); None accepts any of BATCH_URLS."""
    try:
        item = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        return BatchLine(line_no, None, error=LineError("invalid_json", f"line {line_no}: not valid JSON ({e})"))
    if not isinstance(item, dict):
        return BatchLine(line_no, None, error=LineError("invalid_request", f"line {line_no}: must be a JSON object"))
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(line_no, None, error=LineError(
            "invalid_request", f"line {line_no}: custom_id must be a non-empty string"))
    line = BatchLine(line_no, custom_id)
    method, url, body = item.get("method", "POST"), item.get("url"), item.get("body")
    if not isinstance(method, str) or method.upper() != "POST":
        line.error = LineError("invalid_method", f"method must be POST, got {method!r}")
    elif not isinstance(url, str) or url not in BATCH_URLS:
        line.error = LineError("invalid_url", f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}")
    elif endpoint is not None and url != endpoint:
        line.error = LineError("invalid_url", f"url {url!r} differs from the batch's endpoint {endpoint!r}")
    elif url == EMBEDDINGS_URL:
        line.error = LineError("model_not_supported", NO_EMBEDDINGS, 400)
    elif not isinstance(body, dict):
        line.error = LineError("invalid_body", "body must be a JSON object")
    elif body.get("stream"):
        line.error = LineError("invalid_body", "stream: a batch line is answered whole; omit stream or send false")
    else:
        line.url, line.body = url, body
    return line


def duplicate_error(custom_id: str) -> LineError:
    return LineError("duplicate_custom_id", f"custom_id {custom_id!r} appears on an earlier line: each "
                                            f"custom_id must be unique in a batch")


def result_record(custom_id: str | None, status: int, body: Any) -> dict[str, Any]:
    """The output line for a line a route answered: `body` is the route's JSON answer."""
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    record = {"id": _record_id(), "custom_id": custom_id,
              "response": {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex}",
                           "body": body}, "error": None}
    if not 200 <= status < 300:
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        record["error"] = {"code": error.get("code") or error.get("type") or f"http_{status}",
                           "message": str(error.get("message") or body)}
    return record


def error_record(custom_id: str | None, error: LineError) -> dict[str, Any]:
    """The output line for a line refused without a route's answer (or with the status the server
    would give, as for embeddings)."""
    response = None
    if error.status is not None:
        response = {"status_code": error.status, "request_id": f"req_{uuid.uuid4().hex}",
                    "body": {"error": {"message": error.message, "type": "invalid_request_error",
                                       "param": None, "code": error.code}}}
    return {"id": _record_id(), "custom_id": custom_id, "response": response,
            "error": {"code": error.code, "message": error.message}}


def is_success(record: dict[str, Any]) -> bool:
    return record.get("error") is None


def dump_record(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def read_lines(path: str, endpoint: str | None = None) -> Iterator[BatchLine]:
    """The non-blank lines of a batch input file, parsed one at a time."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if raw.strip():
                yield parse_line(raw, line_no, endpoint)


def count_results(path: str) -> collections.Counter:
    """How many records each custom_id has in an output file (key None: lines that had none). A
    last line without its newline (the writer was killed mid-line) is cut off the file first."""
    counts: collections.Counter = collections.Counter()
    if not os.path.exists(path):
        return counts
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
    for raw in data[:end].splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict):
            custom_id = record.get("custom_id")
            counts[custom_id if isinstance(custom_id, str) else None] += 1
    return counts
