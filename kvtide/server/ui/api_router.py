"""Route: GET / -> the chat page (`chat.html`, one self-contained file: inline CSS and JS, no
external resources, so it works on a machine without internet).

The page holds no secret and is served without the API key (see middleware.py); the key, when the
server has one, is typed into the page and sent only in the Authorization header of its API calls.
The Content-Security-Policy lets only the page's own inline script (pinned by its sha256) and style
run, and lets it connect only to this server: an injected script or an external fetch is refused
by the browser even if a bug ever put model output into the DOM as markup.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()

_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


@functools.cache
def chat_page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy (read once from the package data)."""
    html = resources.files(__package__).joinpath("chat.html").read_text(encoding="utf-8")
    hashes = " ".join("'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
                      for s in _SCRIPT.findall(html))
    csp = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
           "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html.encode("utf-8"), csp


@router.get("/", include_in_schema=False)
async def chat_ui() -> HTMLResponse:
    body, csp = chat_page()
    return HTMLResponse(body, headers={"Content-Security-Policy": csp, "Cache-Control": "no-cache",
                                       "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})
