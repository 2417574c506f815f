"""StructuredOutputManager: compiles grammars off the engine loop and hands each constrained
request its matcher once its grammar is ready.

Compilation runs in separate processes (compile_pool.py), each compile under a time and a memory
limit, so the engine keeps stepping other requests while a new grammar compiles and a huge one
fails alone; the scheduler leaves a request in the waiting queue, not the batch, until its grammar
is ready. A compile nobody waits for any more (all its requests aborted) is cancelled. Compiled
grammars are cached by (constraint, options), least recently used dropped first once they hold
more than `cache_bytes`: the tokenizer is fixed per engine, so that is the whole key. The tokenizer
and xgrammar's view of its vocabulary are built on first use, on the pool's thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtide.structured_output.compile_pool import CompilePool

if TYPE_CHECKING:
    from kvtide.config import StructuredOutputsConfig


FAILED_ENTRY_BYTES = 1024
"""What a cached compile error counts against cache_bytes."""


@dataclass
class _CacheEntry:
    future: Future
    size: int = 0
    """The compiled grammar's bytes (xgrammar's memory_size_bytes); 0 while compiling."""


@dataclass
class StructuredOutputStats:
    """Counters since the engine started, and the most recent compile times numbered in order,
    so each reader (the server's metrics) observes every time once."""

    num_constrained_requests: int = 0
    num_cache_hits: int = 0
    num_compiled: int = 0
    num_compile_errors: int = 0
    num_compile_timeouts: int = 0
    num_compiles_cancelled: int = 0
    """Compiles stopped because every request waiting for them was aborted."""
    cache_bytes: int = 0
    """Bytes of compiled grammars in the cache."""
    num_jump_forward_tokens: int = 0
    compile_seconds: deque = field(default_factory=lambda: deque(maxlen=1024))
    """(compilation number, seconds), the last 1024."""

    def as_dict(self) -> dict[str, Any]:
        figures = {k: v for k, v in self.__dict__.items() if k != "compile_seconds"}
        figures["compile_seconds"] = [list(entry) for entry in self.compile_seconds]
        return figures


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, enable_jump_forward: bool = True,
                 config: StructuredOutputsConfig | None = None) -> None:
        if config is None:
            from kvtide.config import StructuredOutputsConfig

            config = StructuredOutputsConfig()
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.enable_jump_forward = enable_jump_forward
        self.cache_bytes = int(config.cache_bytes)
        self._utf8_guard = None
        self._cache: OrderedDict[tuple, _CacheEntry] = OrderedDict()
        self._cached_bytes = 0
        self._waiters: dict[Future, set[str]] = {}
        """A compile in progress -> the requests waiting for it (it is cancelled when none is left)."""
        self._lock = threading.Lock()
        self.stats = StructuredOutputStats()
        self.pool = CompilePool(self._tokenizer_info, workers=config.compile_workers,
                                timeout_s=config.compile_timeout_s, memory_limit=int(config.compile_memory_limit),
                                max_whitespace_cnt=config.max_whitespace_cnt, on_result=self._record)

    # ---- admission -----------------------------------------------------------------------------
    def add_request(self, request) -> None:
        """Start (or find) the compilation of the request's grammar."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        self.stats.num_constrained_requests += 1
        key = params.key()
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
                new = False
            else:
                entry = self._cache[key] = _CacheEntry(self.pool.submit(params))
                new = True
            future = entry.future
            if not future.done():
                self._waiters.setdefault(future, set()).add(request.request_id)
        if new:
            future.add_done_callback(lambda done: self._compiled(key, done))
        request.grammar_future = future

    def remove_request(self, request) -> None:
        """The request ended (aborted) before its grammar was ready: when no other request waits
        for that compile, cancel it (its process is stopped, or the queued job dropped)."""
        future = request.grammar_future
        if future is None:
            return
        request.grammar_future = None
        with self._lock:
            waiters = self._waiters.get(future)
            if waiters is None or future.done():
                return
            waiters.discard(request.request_id)
            if waiters:
                return
            del self._waiters[future]
            key = request.sampling_params.structured_outputs.key()
            entry = self._cache.get(key)
            if entry is not None and entry.future is future:
                del self._cache[key]
            self.stats.num_compiles_cancelled += 1
        self.pool.cancel(future)

    def make_ready(self, request) -> None:
        """Give a request its matcher now, waiting for the compilation if need be: a fork of a
        running request (an n > 1 sibling) shares its constraint, so that one is compiled."""
        if request.grammar_future is not None:
            wait([request.grammar_future])
            self.is_ready(request)

    def is_ready(self, request) -> bool:
        """Whether the request may be scheduled: no grammar, or its matcher made (or its
        compilation failed: `request.grammar_error` says why, and the scheduler ends it)."""
        future = request.grammar_future
        if future is None:
            return True
        if not future.done():
            return False
        request.grammar_future = None
        try:
            compiled = future.result()
        except (Exception, CancelledError) as e:  # CompileError: a constraint the frontend's parse let through
            request.grammar_error = str(e) or "the structured output grammar compile was cancelled"
            request.grammar_error_status = getattr(e, "status", 400)
            return True
        from kvtide.structured_output.grammar import RequestGrammar

        params = request.sampling_params.structured_outputs
        request.grammar = RequestGrammar(compiled, sorted(request.eos_token_ids), params.reasoning_end_token_ids,
                                         self._utf8_guard)
        return True

    def wait_for_compilation(self, timeout: float) -> None:
        """Block up to `timeout` s for a pending compilation (the engine has nothing else to run)."""
        with self._lock:
            pending = [e.future for e in self._cache.values() if not e.future.done()]
        if pending:
            wait(pending, timeout, FIRST_COMPLETED)

    # ---- the cache -----------------------------------------------------------------------------
    def _compiled(self, key: tuple, future: Future) -> None:
        """A compile ended (on the pool's thread): count its bytes into the cache, dropping the
        least recently used grammars past cache_bytes; a cancelled one leaves the cache, a failed one
        stays as its error."""
        with self._lock:
            self._waiters.pop(future, None)
            entry = self._cache.get(key)
            if entry is None or entry.future is not future:
                return
            if future.cancelled():
                del self._cache[key]
                return
            # A failed compile stays cached as its error, so the same hostile grammar sent again
            # fails at once instead of holding a compiler process for its whole time limit again.
            failed = future.exception() is not None
            entry.size = FAILED_ENTRY_BYTES if failed else max(1, int(future.result().memory_size_bytes))
            self._cached_bytes += entry.size
            for old_key in list(self._cache):
                if self._cached_bytes <= self.cache_bytes:
                    break
                old = self._cache[old_key]
                if old.size:  # compiling ones hold no bytes yet
                    del self._cache[old_key]
                    self._cached_bytes -= old.size
            self.stats.cache_bytes = self._cached_bytes

    def _record(self, seconds: float | None, timed_out: bool = False) -> None:
        """The pool's report of each compile: its time, or that it failed."""
        if seconds is None:
            self.stats.num_compile_errors += 1
            self.stats.num_compile_timeouts += timed_out
            return
        self.stats.num_compiled += 1
        self.stats.compile_seconds.append((self.stats.num_compiled, seconds))

    # ---- per step ------------------------------------------------------------------------------
    def grammar_step(self, sampling_requests: list):
        """The runner's view of this step's constrained rows (None when there are none)."""
        grammars, token_ids = {}, {}
        for r in sampling_requests:
            if r.grammar is not None:
                grammars[r.request_id] = r.grammar
                token_ids[r.request_id] = r.all_token_ids
        if not grammars:
            return None
        from kvtide.structured_output.step import GrammarStep

        return GrammarStep(grammars, self.vocab_size, token_ids)

    def jump_forward_for(self, request) -> bool:
        """Jump-forward applies unless off, or the request wants logprobs (each token needs its
        own forward pass) or is a beam."""
        params = request.sampling_params
        return self.enable_jump_forward and params.logprobs is None and not params.use_beam_search

    # ---- the compiler's vocabulary ---------------------------------------------------------------
    def _tokenizer_info(self):
        """xgrammar's view of the vocabulary (built once, on the pool's thread at the first compile),
        and the Utf8Guard that goes with it."""
        import xgrammar as xgr

        from kvtide.structured_output.utf8_guard import Utf8Guard

        info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
        self._utf8_guard = Utf8Guard(info.decoded_vocab, self.vocab_size)
        return info

    def shutdown(self) -> None:
        self.pool.shutdown()
