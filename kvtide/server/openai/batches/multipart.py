"""multipart/form-data bodies (what OpenAI's clients upload to /v1/files), parsed from bytes the
guard middleware has already read within its size limit."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtide.server.errors import OpenAIError

_BOUNDARY = re.compile(r';\s*boundary="?([^";]+)"?', re.IGNORECASE)
_NAME = re.compile(r'(?:^|;)\s*name="([^"]*)"', re.IGNORECASE)
_FILENAME = re.compile(r'(?:^|;)\s*filename="([^"]*)"', re.IGNORECASE)


@dataclass
class FormField:
    value: bytes
    filename: str | None = None
    """Set for a file part (its Content-Disposition names a filename)."""


def parse_form(content_type: str | None, body: bytes) -> dict[str, FormField]:
    """The fields of a multipart/form-data body by name (the first of a repeated name wins); 415
    for another content type, 400 for a body that is not well formed."""
    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        raise OpenAIError(f"Content-Type {content_type!r} is not supported here: upload the file as "
                          "multipart/form-data", 415, param="Content-Type", code="unsupported_media_type")
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise OpenAIError("multipart/form-data without a boundary", 400, code="invalid_body")
    delimiter = b"--" + match.group(1).encode("latin-1")
    parts = body.split(delimiter)
    if len(parts) < 3 or not parts[-1].startswith(b"--"):
        raise OpenAIError("malformed multipart/form-data body (no closing boundary)", 400, code="invalid_body")
    fields: dict[str, FormField] = {}
    for part in parts[1:-1]:
        head, sep, value = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            raise OpenAIError("malformed multipart/form-data part (no blank line after its headers)", 400,
                              code="invalid_body")
        disposition = ""
        for line in head.decode("utf-8", "replace").split("\r\n"):
            name, _, rest = line.partition(":")
            if name.strip().lower() == "content-disposition":
                disposition = rest
        name_match = _NAME.search(disposition)
        if name_match is None:
            raise OpenAIError("multipart/form-data part without a name", 400, code="invalid_body")
        filename = _FILENAME.search(disposition)
        fields.setdefault(name_match.group(1), FormField(value.removesuffix(b"\r\n"),
                                                         filename.group(1) if filename else None))
    return fields
