"""The server's CPU-heavy request preparation, run off the asyncio event loop so that /health and
every stream keep answering while one request's template renders or its prompt tokenizes.

Rendering has its own small pool (a runaway template holds a worker only until its deadline,
rendering.py). Tokenization has one worker: Hugging Face tokenizers release the GIL while they
encode, but one tokenizer used from two threads at once can fail ("Already borrowed"), as vLLM
found; the texts reaching it are bounded (prompt_chars_limit), so each job is short.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtide.server.errors import OpenAIError

T = TypeVar("T")

RENDER_WORKERS = 2
"""Chat templates rendering at once; more wait their turn (each stops at its deadline)."""

_render_pool = ThreadPoolExecutor(max_workers=RENDER_WORKERS, thread_name_prefix="kvtide-render")
_tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtide-tokenize")


async def render(function: Callable[..., T], *args: Any) -> T:
    """function(*args) on the render pool; it enforces its own deadline."""
    return await asyncio.get_running_loop().run_in_executor(_render_pool, functools.partial(function, *args))


async def tokenize(function: Callable[..., T], *args: Any, timeout_s: float, param: str) -> T:
    """function(*args) on the tokenizer's thread; 503 if it has not finished within timeout_s
    (the work itself cannot be interrupted; the texts it gets are bounded)."""
    future = asyncio.get_running_loop().run_in_executor(_tokenize_pool, functools.partial(function, *args))
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except asyncio.TimeoutError:
        raise OpenAIError(f"tokenizing the prompt took longer than {timeout_s:g} s; the server is busy, retry "
                          f"later", 503, param=param, code="timeout") from None


@functools.lru_cache(maxsize=8)
def _longest_token_chars(tokenizer: Any) -> int:
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1) or 1


def prompt_chars_limit(tokenizer: Any, max_model_len: int) -> int:
    """Characters a prompt of max_model_len tokens can hold at most: no token stands for more
    characters than its vocabulary entry has (byte-level BPE and SentencePiece alike). A longer
    text cannot fit, so it is refused without tokenizing it (seconds of CPU for megabytes)."""
    return max_model_len * _longest_token_chars(tokenizer)


def check_prompt_chars(tokenizer: Any, text: str, max_model_len: int, param: str) -> None:
    limit = prompt_chars_limit(tokenizer, max_model_len)
    if len(text) > limit:
        raise OpenAIError(f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
                          f"{len(text)} characters, more than {max_model_len} tokens can hold ({limit}).", 400,
                          param=param, code="context_length_exceeded")
