"""The batch jobs' server flags and what they set (plain Python: `kvtide serve` reads its flags
before it imports its web stack)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtide.sizes import parse_size

DEFAULT_MAX_FILE_BYTES = 100 * 1024 * 1024
DEFAULT_MAX_FILE_LINES = 50_000
DEFAULT_MAX_CONCURRENCY = 32
MULTIPART_SLACK_BYTES = 64 * 1024
"""An upload's body may exceed the file by this much: the multipart headers and the purpose field."""


@dataclass
class BatchSettings:
    directory: str | None = None
    """--batch-dir: where uploaded files, batch outputs and batch records live (None: $KVTIDE_CACHE/batches)."""
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    """--max-batch-file-bytes: the largest upload (400 past it)."""
    max_file_lines: int = DEFAULT_MAX_FILE_LINES
    """--max-batch-file-lines: the most requests one file may hold (400 past it)."""
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    """--max-batch-concurrency: batch lines in the engine at once, all batches together."""

    @property
    def max_upload_body(self) -> int:
        """Bytes a POST /v1/files body may have (it is checked before the multipart is parsed)."""
        return self.max_file_bytes + MULTIPART_SLACK_BYTES


def add_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-dir", default=None, metavar="DIR",
                   help="where /v1/files keeps uploads and batch outputs and /v1/batches its records "
                        "(created 0700; default: $KVTIDE_CACHE/batches)")
    p.add_argument("--max-batch-file-bytes", default=str(DEFAULT_MAX_FILE_BYTES),
                   help="largest /v1/files upload, in bytes or with a unit ('16MiB'); 400 past it")
    p.add_argument("--max-batch-file-lines", type=int, default=DEFAULT_MAX_FILE_LINES,
                   help="most request lines one uploaded batch file may hold; 400 past it")
    p.add_argument("--max-batch-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help="batch lines in the engine at once, all batches together; they run at a lower "
                        "priority than interactive requests under --scheduling-policy priority")


def batch_settings_from_args(args: argparse.Namespace) -> BatchSettings:
    settings = BatchSettings(directory=args.batch_dir,
                             max_file_bytes=parse_size(args.max_batch_file_bytes, "--max-batch-file-bytes"),
                             max_file_lines=args.max_batch_file_lines, max_concurrency=args.max_batch_concurrency)
    for flag, value in (("--max-batch-file-bytes", settings.max_file_bytes),
                        ("--max-batch-file-lines", settings.max_file_lines),
                        ("--max-batch-concurrency", settings.max_concurrency)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1")
    return settings
