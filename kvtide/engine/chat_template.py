"""`--chat-template VALUE` (serve, chat): a path to a Jinja template file, or the template itself."""

from __future__ import annotations

import os


def read_chat_template(value: str | None) -> str | None:
    """The template text, None when not given; a value that is neither a file nor Jinja is an error."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value
