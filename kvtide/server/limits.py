"""Request limits of the HTTP server: one named constant each, so the protocol models, the guard
middleware, `kvtide serve --help` and the tests read the same numbers.

Values follow OpenAI's API or vLLM where they have one; the others are generous bounds whose only
job is to keep one request from costing the server unbounded memory or time.
"""

from __future__ import annotations

from kvtide.sampling_params import MAX_LOGPROBS

MAX_N = 128
"""Completions per request (n): OpenAI's maximum."""
MAX_BEST_OF = MAX_N
"""best_of (only best_of == n is supported)."""
MAX_TOP_LOGPROBS = MAX_LOGPROBS
"""logprobs (completions) and top_logprobs (chat): vLLM's default max_logprobs, 20."""
MAX_STOP_STRINGS = 64
"""Stop strings per request (OpenAI allows 4, vLLM any number: each costs a scan per token)."""
MAX_STOP_STRING_CHARS = 1024
"""Characters in one stop string."""
MAX_STOP_TOKEN_IDS = 1024
"""stop_token_ids entries."""
MAX_LOGIT_BIAS = 300
"""logit_bias entries (OpenAI's bound)."""
MAX_HEADER_BYTES = 16 * 1024
"""Request header bytes (names + values, summed); more gets 431. uvicorn's h11 parser itself is
given 4x this, beyond which it answers a bare 400 before the app sees the request."""
DEFAULT_MAX_REQUEST_BODY = 4 * 1024 * 1024
"""Request body bytes unless --max-request-body says otherwise; more gets 413."""


def describe() -> str:
    """The limits as `kvtide serve --help` prints them."""
    return (f"request limits (400 past each): n <= {MAX_N}, best_of <= {MAX_BEST_OF}, "
            f"logprobs/top_logprobs <= {MAX_TOP_LOGPROBS}, stop strings <= {MAX_STOP_STRINGS} "
            f"(each <= {MAX_STOP_STRING_CHARS} chars), stop_token_ids <= {MAX_STOP_TOKEN_IDS}, "
            f"logit_bias entries <= {MAX_LOGIT_BIAS}; headers <= {MAX_HEADER_BYTES} bytes (431); "
            f"body <= --max-request-body (413).")
