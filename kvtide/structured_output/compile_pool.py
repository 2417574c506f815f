"""CompilePool: grammar compilation in child processes, each compile under a time and a memory
limit, so one huge or hostile grammar costs only its own requests.

Compiling a grammar can take minutes and gigabytes (ten thousand choices, thousands of tool
schemas), which on a thread inside the engine would queue every constrained request behind it and
could get the whole engine killed for memory. Here each compile runs in a compile_worker.py
process (up to `workers` of them, started as jobs need them):

- past `timeout_s` its process is killed and replaced, and the job fails with CompileTimeout;
- a compile that needs more than `memory_limit` bytes fails (or its process dies) and the
  process is replaced; the job fails with CompileError;
- `cancel` drops a queued job, or kills the process running it, when nobody waits for it any more.

The result comes back as the CompiledGrammar's JSON (xgrammar's own serialization), read into a
CompiledGrammar against this process's TokenizerInfo. The TokenizerInfo is built here once, on
first use, and handed to each process as JSON when it starts (not rebuilt per compile).

One thread ("kvtide-grammar") does all of it: starting processes, sending jobs, reading results,
enforcing deadlines. The engine only submits, cancels and reads futures.
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtide.sampling_params import StructuredOutputsParams
from kvtide.structured_output.compile_worker import read_frame, write_frame

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""How long a compiler process may take to start (import xgrammar, read the vocabulary)."""
TICK_S = 0.25
"""The longest the pool's thread sleeps between deadline checks."""


class CompileError(Exception):
    """A grammar that did not compile. `status` is the HTTP status the server answers with: the
    request itself is at fault (400), or it ran out of time (408)."""

    status = 400


class CompileTimeout(CompileError):
    status = 408


@dataclass
class _Job:
    params: StructuredOutputsParams
    future: Future = field(default_factory=Future)
    started: float | None = None


@dataclass
class _Worker:
    process: subprocess.Popen
    spawned: float = field(default_factory=time.monotonic)
    ready: bool = False
    job: _Job | None = None

    @property
    def idle(self) -> bool:
        return self.ready and self.job is None


class CompilePool:
    def __init__(self, make_tokenizer_info: Callable[[], Any], workers: int = 2, timeout_s: float = 30.0,
                 memory_limit: int | None = None, max_whitespace_cnt: int | None = None,
                 max_threads: int | None = None,
                 on_result: Callable[[float | None, bool], None] | None = None) -> None:
        """on_result(seconds, timed_out) after each compile: its seconds, or None if it failed."""
        self._on_result = on_result or (lambda seconds, timed_out: None)
        self._make_tokenizer_info = make_tokenizer_info
        self.tokenizer_info = None
        """xgrammar's TokenizerInfo, built on the pool's thread at the first job."""
        self._info_json: str | None = None
        """The TokenizerInfo's JSON, in a private file the processes read at start."""
        self._info_dir: str | None = None
        self.num_workers = workers
        self.timeout_s = timeout_s
        self.memory_limit = memory_limit
        self.max_whitespace_cnt = max_whitespace_cnt
        self.max_threads = max_threads or max(1, min(8, (os.cpu_count() or 1) // 2))
        """xgrammar's threads per compile: half the cores at most, so compiles leave the engine some."""
        self._queue: deque[_Job] = deque()
        self._cancelled: set[Future] = set()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._closed = False
        self.num_started = 0
        """Compiler processes started so far (replacements included)."""
        self._thread = threading.Thread(target=self._run, name="kvtide-grammar", daemon=True)
        self._thread.start()

    # ---- the engine's side ---------------------------------------------------------------------
    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the CompiledGrammar (or CompileError)."""
        job = _Job(params)
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compile pool is shut down")
            self._queue.append(job)
        self._wake()
        return job.future

    def cancel(self, future: Future) -> None:
        """Nobody waits for this compile any more: drop it, or stop the process running it."""
        with self._lock:
            self._cancelled.add(future)
        self._wake()

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in list(self._workers)]

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._queue)
            self._queue.clear()
        for job in jobs:
            job.future.cancel()
        os.write(self._wake_write, b"x")
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _wake(self) -> None:
        if self._closed:
            return
        try:
            os.write(self._wake_write, b"x")
        except OSError:  # shut down, or the pipe is full (a wake-up is pending anyway)
            pass

    # ---- the pool's thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed:
                self._handle_cancels()
                self._dispatch()
                for key, _ in self._selector.select(self._next_wait()):
                    if key.data is None:
                        self._drain_wake()
                    else:
                        self._read(key.data)
                self._enforce_deadlines()
        except Exception:  # a bug here must not leave requests waiting forever
            logger.exception("grammar compile pool failed")
            self._fail_everything(CompileError("the grammar compiler failed; see the server log"))
        finally:
            for worker in list(self._workers):
                self._stop(worker)
            self._selector.close()
            if self._info_dir is not None:
                shutil.rmtree(self._info_dir, ignore_errors=True)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _next_wait(self) -> float:
        now = time.monotonic()
        deadlines = [w.job.started + self.timeout_s for w in self._workers if w.job and w.job.started]
        return max(0.0, min([TICK_S] + [d - now for d in deadlines]))

    def _handle_cancels(self) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            if not cancelled:
                return
            kept = [job for job in self._queue if job.future not in cancelled]
            dropped = len(self._queue) - len(kept)
            self._queue = deque(kept)
        for worker in list(self._workers):
            if worker.job is not None and worker.job.future in cancelled:
                logger.info("grammar compile cancelled after %.1f s (its requests were aborted)",
                            time.monotonic() - (worker.job.started or worker.spawned))
                self._replace(worker)
        for future in cancelled:
            future.cancel()
        if dropped:
            logger.debug("%d queued grammar compiles dropped (their requests were aborted)", dropped)

    def _dispatch(self) -> None:
        with self._lock:
            if not self._queue:
                return
        if self._info_json is None and not self._load_tokenizer_info():
            return
        for worker in self._workers:
            if worker.idle:
                with self._lock:
                    if not self._queue:
                        return
                    job = self._queue.popleft()
                self._send(worker, job)
        with self._lock:
            waiting = len(self._queue) - sum(1 for w in self._workers if not w.ready)
        while waiting > 0 and len(self._workers) < self.num_workers:
            self._spawn()
            waiting -= 1

    def _load_tokenizer_info(self) -> bool:
        try:
            self.tokenizer_info = self._make_tokenizer_info()
            # handed to each process as a file (a large vocabulary's JSON is megabytes; a pipe
            # would hold this thread until the process has started and read it)
            self._info_dir = tempfile.mkdtemp(prefix="kvtide-grammar-")
            self._info_json = os.path.join(self._info_dir, "tokenizer_info.json")
            with open(os.open(self._info_json, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(self.tokenizer_info.serialize_json())
            return True
        except Exception as e:  # no tokenizer: every waiting compile fails with the reason
            self._fail_queued(CompileError(f"cannot compile the structured output grammar: {e}"))
            return False

    def _spawn(self) -> None:
        # kvtide importable there as here, however this process found it
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        process = subprocess.Popen([sys.executable, "-m", "kvtide.structured_output.compile_worker"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=env)
        worker = _Worker(process)
        self._workers.append(worker)
        self.num_started += 1
        self._selector.register(process.stdout, selectors.EVENT_READ, worker)
        try:
            write_frame(process.stdin, {"tokenizer_info_path": self._info_json, "memory_limit": self.memory_limit,
                                        "max_threads": self.max_threads})
        except OSError:  # it died at once: the read side reports it
            pass

    def _send(self, worker: _Worker, job: _Job) -> None:
        worker.job = job
        job.started = time.monotonic()
        try:
            write_frame(worker.process.stdin, {"params": asdict(job.params),
                                               "max_whitespace_cnt": self.max_whitespace_cnt})
        except OSError:  # it died between jobs: the read side reports it
            pass

    def _read(self, worker: _Worker) -> None:
        try:
            message = read_frame(worker.process.stdout)
        except (OSError, ValueError):
            message = None
        if message is None:
            self._worker_died(worker)
            return
        header, payload = message
        if header.get("ready"):
            worker.ready = True
            return
        job, worker.job = worker.job, None
        if job is None or job.future.done():
            return
        if header["ok"]:
            import xgrammar as xgr

            compiled = xgr.CompiledGrammar.deserialize_json(payload.decode(), self.tokenizer_info)
            self._on_result(header["seconds"], False)
            _settle(job.future, result=compiled)
            return
        self._on_result(None, False)
        if header.get("kind") == "memory":
            _settle(job.future, error=CompileError(self._memory_message()))
            self._replace(worker)  # its heap may be in pieces after an allocation failed: start afresh
            return
        _settle(job.future, error=CompileError(f"cannot compile the structured output grammar: {header['error']}"))

    def _worker_died(self, worker: _Worker) -> None:
        try:
            code = worker.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        job = worker.job
        if worker.ready:
            self._replace(worker)
        else:
            self._stop(worker)
        if job is not None:
            self._on_result(None, False)
            logger.warning("grammar compiler process exited (code %s) while compiling a %s constraint",
                           code, job.params.kind)
            _settle(job.future, error=CompileError(self._memory_message(f" (its process exited with code {code})")))
        elif not worker.ready:  # it never started: the jobs waiting for it would wait forever
            logger.error("grammar compiler process failed to start (exit code %s)", code)
            self._fail_queued(CompileError(f"the grammar compiler process failed to start (exit code {code})"))

    def _memory_message(self, detail: str = "") -> str:
        limit = f"{self.memory_limit} bytes" if self.memory_limit else "the machine's memory"
        return (f"structured output grammar too large: compiling it exceeded the compile memory limit "
                f"({limit}; structured_outputs_config.compile_memory_limit){detail}")

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            job = worker.job
            if job is not None and job.started is not None and now - job.started > self.timeout_s:
                logger.warning("grammar compile of a %s constraint passed %.1f s: stopped", job.params.kind,
                               self.timeout_s)
                self._replace(worker)
                self._on_result(None, True)
                _settle(job.future, error=CompileTimeout(
                    f"structured output grammar took too long to compile (over {self.timeout_s:g} s; "
                    "structured_outputs_config.compile_timeout_s)"))
            elif not worker.ready and now - worker.spawned > START_TIMEOUT_S:
                self._stop(worker)
                self._fail_queued(CompileError("the grammar compiler process did not start in time"))

    def _replace(self, worker: _Worker) -> None:
        """Kill a process and start its successor now, so the next compile does not wait for one
        to start (seconds: the interpreter, xgrammar and torch)."""
        if not self._closed:
            self._spawn()
        self._stop(worker)

    def _stop(self, worker: _Worker) -> None:
        """Kill a process and forget it (a job it held is settled by the caller)."""
        try:
            self._selector.unregister(worker.process.stdout)
        except (KeyError, ValueError):
            pass
        worker.process.kill()
        worker.process.wait()
        if worker in self._workers:
            self._workers.remove(worker)
        for stream in (worker.process.stdin, worker.process.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def _fail_queued(self, error: CompileError) -> None:
        with self._lock:
            jobs = list(self._queue)
            self._queue.clear()
        for job in jobs:
            _settle(job.future, error=error)

    def _fail_everything(self, error: CompileError) -> None:
        self._fail_queued(error)
        for worker in list(self._workers):
            if worker.job is not None:
                _settle(worker.job.future, error=error)


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete a future unless it was cancelled meanwhile."""
    if future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except Exception:  # cancelled between the check and the set (InvalidStateError)
        pass
