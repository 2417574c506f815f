"""`@kl.function`: a Python function of a state and arguments becomes a program that runs on a
backend, alone (`run`) or many at once (`run_batch`, whose threads' calls the backend batches).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from kvtide.lang.backend import Backend
from kvtide.lang.chat import ChatRenderer
from kvtide.lang.state import ProgramState

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend `run` and `run_batch` use when given none."""
    global _default_backend
    _default_backend = backend


def _resolve(backend: Backend | None) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise ValueError("no backend: pass backend=kl.Engine(llm) or kl.Endpoint(url), or call "
                         "kl.set_default_backend")
    return backend


class Program:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, *args: Any, backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        """Run the program; an exception from a call (or from the program's own code) propagates."""
        state = ProgramState(_resolve(backend))
        self.fn(state, *args, **kwargs)
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], backend: Backend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False) -> list[ProgramState]:
        """Run the program once per kwargs dict on `num_threads` threads ("auto": one per program,
        up to 4 per CPU core, at most 64); the states come back in order. A program that raised
        keeps its partial state with the exception in `state.error`."""
        resolved = _resolve(backend)
        renderer = ChatRenderer(resolved.render_chat)  # one template cache for the batch
        if num_threads == "auto":
            num_threads = max(1, min(len(batch_kwargs), 4 * (os.cpu_count() or 1), 64))
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"run_batch: num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")

        def run_one(kwargs: dict[str, Any]) -> ProgramState:
            state = ProgramState(resolved, renderer)
            try:
                self.fn(state, **kwargs)
            except Exception as e:
                state.error = e
            return state

        states: list[ProgramState] = []
        with ThreadPoolExecutor(max_workers=num_threads) as pool, \
                tqdm(total=len(batch_kwargs), desc="Programs", disable=not progress_bar) as bar:
            for state in pool.map(run_one, batch_kwargs):
                states.append(state)
                bar.update(1)
        return states

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(fn: Callable[..., Any]) -> Program:
    """Make `fn(state, ...)` a program: `fn.run(..., backend=...)`, `fn.run_batch([...], backend=...)`."""
    return Program(fn)
