"""StructuredOutputManager: compiles grammars off the engine loop and hands each constrained
request its matcher once its grammar is ready.

Compilation runs on one worker thread (xgrammar compiles with its own threads inside), so the
engine keeps stepping other requests while a new schema compiles; the scheduler leaves a request
in the waiting queue, not the batch, until its grammar is ready. Compiled grammars are cached by
(constraint, options): the tokenizer is fixed per engine, so that is the whole key. The tokenizer
and xgrammar's view of its vocabulary are built on first use, on the same worker.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from kvtide.sampling_params import StructuredOutputsParams
from kvtide.structured_output.grammars import build_grammar

CACHE_SIZE = 1024
"""Compiled grammars kept (least recently used dropped first)."""


@dataclass
class StructuredOutputStats:
    """Counters since the engine started, and the most recent compile times numbered in order,
    so each reader (the server's metrics) observes every time once."""

    num_constrained_requests: int = 0
    num_cache_hits: int = 0
    num_compiled: int = 0
    num_compile_errors: int = 0
    num_jump_forward_tokens: int = 0
    compile_seconds: deque = field(default_factory=lambda: deque(maxlen=1024))
    """(compilation number, seconds), the last 1024."""

    def as_dict(self) -> dict[str, Any]:
        figures = {k: v for k, v in self.__dict__.items() if k != "compile_seconds"}
        figures["compile_seconds"] = [list(entry) for entry in self.compile_seconds]
        return figures


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, enable_jump_forward: bool = True) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.enable_jump_forward = enable_jump_forward
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtide-grammar")
        self._compiler = None
        self._utf8_guard = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = StructuredOutputStats()

    # ---- admission -----------------------------------------------------------------------------
    def add_request(self, request) -> None:
        """Start (or find) the compilation of the request's grammar."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        self.stats.num_constrained_requests += 1
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
            else:
                future = self._pool.submit(self._compile, params)
                self._cache[key] = future
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        request.grammar_future = future

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
        except Exception as e:  # a constraint the frontend's parse let through
            request.grammar_error = f"cannot compile the structured output grammar: {e}"
            with self._lock:
                self._cache.pop(request.sampling_params.structured_outputs.key(), None)
            return True
        from kvtide.structured_output.grammar import RequestGrammar

        params = request.sampling_params.structured_outputs
        request.grammar = RequestGrammar(compiled, sorted(request.eos_token_ids), params.reasoning_end_token_ids,
                                         self._utf8_guard)
        return True

    def wait_for_compilation(self, timeout: float) -> None:
        """Block up to `timeout` s for a pending compilation (the engine has nothing else to run)."""
        with self._lock:
            pending = [f for f in self._cache.values() if not f.done()]
        if pending:
            wait(pending, timeout, FIRST_COMPLETED)

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

    # ---- the worker ----------------------------------------------------------------------------
    def _compile(self, params: StructuredOutputsParams):
        start = time.perf_counter()
        try:
            compiled = self._get_compiler().compile_grammar(build_grammar(params))
        except Exception:
            self.stats.num_compile_errors += 1
            raise
        self.stats.num_compiled += 1
        self.stats.compile_seconds.append((self.stats.num_compiled, time.perf_counter() - start))
        return compiled

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            from kvtide.structured_output.utf8_guard import Utf8Guard

            info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
            self._utf8_guard = Utf8Guard(info.decoded_vocab, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
