"""Request limits of the HTTP server: one named constant each, so the protocol models, the guard
middleware, `kvtide serve --help` and the tests read the same numbers.

Values follow OpenAI's API or vLLM where they have one; the others are generous bounds whose only
job is to keep one request from costing the server unbounded memory or time.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtide.sampling_params import (
    MAX_LOGPROBS,
    MAX_STRUCTURED_CHOICE_BYTES,
    MAX_STRUCTURED_CHOICES,
    MAX_STRUCTURED_GRAMMAR_BYTES,
    MAX_STRUCTURED_SPEC_BYTES,
)

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
MAX_BAD_WORDS = 64
"""bad_words entries (each is checked against the output's tail at every step), of at most
MAX_STOP_STRING_CHARS characters each."""
MAX_HEADER_BYTES = 16 * 1024
"""Request header bytes (names + values, summed); more gets 431. uvicorn's h11 parser itself is
given 4x this, beyond which it answers a bare 400 before the app sees the request."""
DEFAULT_MAX_REQUEST_BODY = 4 * 1024 * 1024
"""Request body bytes unless --max-request-body says otherwise; more gets 413."""
MAX_MESSAGES = 2048
"""Chat messages per request: each is a template iteration and a dict built on the way."""
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
"""Engine sequences one /v1/completions request may start: prompts x n (--max-prompts-per-request).
Every prompt is tokenized and validated before anything is queued."""
DEFAULT_MAX_TOOLS = 128
"""Tools per chat request (OpenAI's bound; --max-tools-per-request). A "required" or named
tool_choice compiles every tool's schema into one grammar."""
DEFAULT_MAX_TOOLS_BYTES = 128 * 1024
"""JSON bytes of a request's tool definitions together (--max-tools-bytes): 128 KiB of schemas
compile in ~1.3 s and ~35 MB against a 49k vocabulary."""
STRUCTURED_SPEC_BYTES = MAX_STRUCTURED_SPEC_BYTES
"""JSON schema text (sampling_params.py: offline too)."""
STRUCTURED_GRAMMAR_BYTES = MAX_STRUCTURED_GRAMMAR_BYTES
"""Regex / EBNF grammar / structural tag text (sampling_params.py)."""
STRUCTURED_CHOICES = MAX_STRUCTURED_CHOICES
"""guided_choice / structured_outputs.choice strings (sampling_params.py)."""
STRUCTURED_CHOICE_BYTES = MAX_STRUCTURED_CHOICE_BYTES
"""Bytes of all choice strings together (sampling_params.py)."""
MAX_CHAT_TEMPLATE_BYTES = 64 * 1024
"""A per-request chat_template's text (with --trust-request-chat-template)."""
CHAT_TEMPLATE_OUTPUT_FACTOR = 2
"""A rendered chat prompt may be at most this many times --max-request-body bytes."""
DEFAULT_RENDER_TIMEOUT_S = 2.0
"""Seconds a chat template may render and the prompt tokenize (--render-timeout), off the event loop."""


@dataclass(frozen=True)
class RequestLimits:
    """The limits `kvtide serve` flags may change (the others are the constants above)."""

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_tools: int = DEFAULT_MAX_TOOLS
    max_tools_bytes: int = DEFAULT_MAX_TOOLS_BYTES
    max_request_body: int = DEFAULT_MAX_REQUEST_BODY
    render_timeout_s: float = DEFAULT_RENDER_TIMEOUT_S
    trust_request_chat_template: bool = False
    """Accept a request's own chat_template (vLLM's --trust-request-chat-template); else 400."""

    @property
    def max_rendered_prompt_bytes(self) -> int:
        return CHAT_TEMPLATE_OUTPUT_FACTOR * self.max_request_body


def describe() -> str:
    """The limits as `kvtide serve --help` prints them."""
    return (f"request limits (400 past each): n <= {MAX_N}, best_of <= {MAX_BEST_OF}, "
            f"logprobs/top_logprobs <= {MAX_TOP_LOGPROBS}, stop strings <= {MAX_STOP_STRINGS} "
            f"(each <= {MAX_STOP_STRING_CHARS} chars), stop_token_ids <= {MAX_STOP_TOKEN_IDS}, "
            f"logit_bias entries <= {MAX_LOGIT_BIAS}, messages <= {MAX_MESSAGES}, prompts x n <= "
            f"--max-prompts-per-request ({DEFAULT_MAX_PROMPTS_PER_REQUEST}), tools <= --max-tools-per-request "
            f"({DEFAULT_MAX_TOOLS}) and --max-tools-bytes ({DEFAULT_MAX_TOOLS_BYTES}), guided/"
            f"structured choices <= {STRUCTURED_CHOICES} (<= {STRUCTURED_CHOICE_BYTES} bytes together), "
            f"JSON schema <= {STRUCTURED_SPEC_BYTES} bytes, regex/grammar/structural tag <= "
            f"{STRUCTURED_GRAMMAR_BYTES} bytes, request "
            f"chat_template <= {MAX_CHAT_TEMPLATE_BYTES} bytes (only with --trust-request-chat-template), "
            f"rendered chat prompt <= {CHAT_TEMPLATE_OUTPUT_FACTOR} x --max-request-body bytes and "
            f"--render-timeout ({DEFAULT_RENDER_TIMEOUT_S:g}) seconds; headers <= {MAX_HEADER_BYTES} bytes (431); body <= "
            f"--max-request-body (413).")
