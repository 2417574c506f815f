"""The FastAPI app and its lifecycle.

    run_server(engine_args, settings, host, port)
      1. AsyncLLM.from_engine_args: spawn the engine-core process (--data-parallel-size N: N of
         them, requests balanced between them), wait until it is ready
      2. build_app: routes (openai/*, their WebSocket twins, the chat page ui/, /internal/* with
         --admin-api-key), exception handlers, the admin-key gate, the guard middleware and, with
         --api-keys-file, the per-key quotas inside it
      3. serve with uvicorn until one of:
           SIGTERM/SIGINT  -> drain: new requests 503, wait for those in flight (at most
                              --shutdown-timeout; then they end with an error), stop; exit 0
           engine death    -> (exit, fatal step error, or silent for --engine-timeout; of any
                              data-parallel replica)
                              /health 503 at once, requests in flight fail, stop after a short
                              linger (so health checks can see the 503); exit 1
      4. stop the engine-core process (always: no child outlives the server)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import kvtide
from kvtide.engine.async_llm import AsyncLLM
from kvtide.engine.core_client import EngineDeadError, SpawnedEngineCore
from kvtide.engine.dp_client import merge_stats
from kvtide.server.admin import AdminGate
from kvtide.server.anthropic.api_router import router as anthropic_router
from kvtide.server.errors import RETRY_AFTER_S, OpenAIError, error_response, install_exception_handlers
from kvtide.server.limits import MAX_HEADER_BYTES
from kvtide.server.metrics import CONTENT_TYPE, ServerMetrics
from kvtide.server.middleware import QUOTA_EXEMPT_PATHS, ServerGuardMiddleware
from kvtide.server.openai.batches.api_router import router as batches_router
from kvtide.server.openai.chat_completions.api_router import router as chat_router
from kvtide.server.openai.completions.api_router import router as completions_router
from kvtide.server.openai.lang.api_router import router as lang_router
from kvtide.server.openai.lora.api_router import router as lora_router
from kvtide.server.openai.lora.modules import LoRAModules
from kvtide.server.openai.pooling.api_router import PoolingModelGuard
from kvtide.server.openai.pooling.api_router import router as pooling_router
from kvtide.server.openai.responses.api_router import router as responses_router
from kvtide.server.openai.tokenize.api_router import router as tokenize_router
from kvtide.server.openai.websocket import router as websocket_router
from kvtide.server.output_parsers import OutputParsers
from kvtide.server.quotas import QuotaMiddleware
from kvtide.server.state import ServerSettings, ServerState, get_state
from kvtide.server.ui.api_router import router as ui_router

logger = logging.getLogger("kvtide.server")

HEALTH_TIMEOUT_S = 5.0
"""/health waits this long for the engine core to answer between steps."""
DEAD_ENGINE_LINGER_S = 3.0
"""After the engine dies, keep answering (503) this long before exiting."""


def build_app(state: ServerState) -> Any:
    app = FastAPI(title="kvtide", version=kvtide.__version__, docs_url=None, redoc_url=None)
    app.state.kvtide = state
    install_exception_handlers(app)
    app.include_router(completions_router)
    app.include_router(chat_router)
    app.include_router(tokenize_router)
    app.include_router(lora_router)
    app.include_router(responses_router)
    app.include_router(anthropic_router)
    app.include_router(websocket_router)
    app.include_router(batches_router)
    app.include_router(lang_router)  # kvtide.lang's choice scoring (/v1/lang/score)
    app.include_router(pooling_router)  # embeddings, classify, score, rerank (kvtide/pooling/)
    app.add_middleware(PoolingModelGuard)  # a pooling model turns generation requests away

    @app.get("/health")
    async def health(raw_request: Request) -> Response:
        s = get_state(raw_request)
        reason = s.unavailable_reason
        if reason is None:
            try:
                await s.engine.check_health(HEALTH_TIMEOUT_S)
            except EngineDeadError as e:
                reason = str(e)
        if reason is not None:
            return error_response(503, f"unhealthy: {reason}", code="unavailable",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvtide.__version__})

    @app.get("/v1/models")
    async def list_models(raw_request: Request) -> JSONResponse:
        s = get_state(raw_request)
        root = s.engine.info.model_dir
        info = s.engine.info
        data = [{"id": name, "object": "model", "created": s.created, "owned_by": "kvtide", "root": root,
                 "parent": None, "max_model_len": s.max_model_len, "architecture": info.architecture,
                 "model_impl": info.model_impl} for name in s.settings.served_model_names]
        data += [{"id": name, "object": "model", "created": s.created, "owned_by": "kvtide", "root": lora.lora_path,
                  "parent": lora.base_model_name or s.model_name, "max_model_len": s.max_model_len,
                  "architecture": info.architecture, "model_impl": info.model_impl}
                 for name, lora in s.loras.adapters.items()]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/metrics")
    async def metrics(raw_request: Request) -> Response:
        s = get_state(raw_request)
        with contextlib.suppress(Exception):  # a dead or busy engine: serve what we have
            s.metrics.update_from_engines(await s.engine.get_engine_stats(timeout_s=2.0))
        s.metrics.update_data_parallel(s.engine.engine_summaries())
        s.metrics.record_invalid_structured_outputs(s.engine.input_processor.num_invalid_structured_outputs)
        return Response(s.metrics.render(), media_type=CONTENT_TYPE)

    if state.settings.admin_api_key:
        _add_internal_routes(app)
    if state.settings.enable_admin_api:
        _add_admin_routes(app)
    if state.settings.enable_ui:
        app.include_router(ui_router)
    inner: Any = app
    if state.settings.enable_sleep_mode:
        from kvtide.server.sleep_mode import SleepGate
        from kvtide.server.sleep_mode import router as sleep_router

        app.include_router(sleep_router)
        inner = SleepGate(app, state)
    if state.settings.api_keys is not None:
        # Inside the guard: draining, header and body limits come first; the guard checks the key
        # only on the paths the quotas skip.
        inner = QuotaMiddleware(inner, state.settings.api_keys, registry=state.metrics.registry,
                                exempt_paths=QUOTA_EXEMPT_PATHS)
    # The admin key, when set, is checked before the guard: it alone opens the admin paths.
    return AdminGate(ServerGuardMiddleware(inner, state), state.settings)


def _add_internal_routes(app: FastAPI) -> None:
    """Engine internals, for tests and debugging: only with --admin-api-key (404 otherwise), and
    only for that key (server/admin.py)."""

    @app.get("/internal/stats")
    async def internal_stats(raw_request: Request) -> JSONResponse:
        """Engine-core SchedulerStats plus process facts (for tests and debugging). With data
        parallelism the stats are summed over the replicas and "data_parallel" has each replica's
        own stats, pid and what the balancer sent it."""
        s = get_state(raw_request)
        per_engine = await s.engine.get_engine_stats()
        body = {**merge_stats(per_engine).__dict__, "engine_core_pid": s.engine.engine_core_pid,
                "engine_core_pids": s.engine.engine_core_pids,
                "num_unfinished_requests": s.engine.num_unfinished_requests}
        summaries = s.engine.engine_summaries()
        if summaries:
            body["data_parallel"] = [{**summary, "stats": stats.__dict__}
                                     for summary, stats in zip(summaries, per_engine, strict=True)]
        return JSONResponse(body)

    @app.post("/internal/check_integrity")
    async def check_integrity(raw_request: Request) -> JSONResponse:
        await get_state(raw_request).engine.check_integrity()
        return JSONResponse({"ok": True})


def _add_admin_routes(app: FastAPI) -> None:
    """Routes that change server-wide state: only with --enable-admin-api (404 otherwise), and
    behind --admin-api-key when it is set, else behind --api-key like every other route."""

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw_request: Request) -> JSONResponse:
        """Forget every cached prefix; refused ("reset": false) while requests hold blocks."""
        return JSONResponse({"reset": await get_state(raw_request).engine.reset_prefix_cache()})


class _UvicornServer(uvicorn.Server):
    """uvicorn, with our own reaction to SIGTERM/SIGINT (drain first; a second signal forces)."""

    def __init__(self, config: uvicorn.Config, lifecycle: _Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not appended to _captured_signals: uvicorn would re-raise it at exit (exit code -15).
        self.lifecycle.on_signal(sig)


class _Lifecycle:
    def __init__(self, state: ServerState, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.loop = loop
        self.server: _UvicornServer | None = None
        self.exit_code = 0
        self._tasks: set[asyncio.Task] = set()

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def on_signal(self, sig: int) -> None:
        assert self.server is not None
        if self.state.draining:
            logger.warning("second %s: stopping now", signal.Signals(sig).name)
            self.server.should_exit = True
            self.server.force_exit = True
            return
        logger.info("%s: draining (new requests get 503; %d in flight; at most %.0f s)",
                    signal.Signals(sig).name, self.state.num_inflight, self.state.settings.shutdown_timeout)
        self.state.draining = True
        self.loop.call_soon_threadsafe(self._spawn, self._drain())

    async def _drain(self) -> None:
        deadline = self.loop.time() + self.state.settings.shutdown_timeout
        while self.state.num_inflight > 0 and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.state.num_inflight:
            logger.warning("shutdown timeout: %d request(s) still in flight are cut off", self.state.num_inflight)
            # Each ends with an error (a stream: an error event and [DONE]), not a cut connection.
            self.state.engine.fail_all_requests(OpenAIError(
                "the server is shutting down (--shutdown-timeout passed)", 503, code="shutting_down"))
            deadline = self.loop.time() + 1.0
            while self.state.num_inflight > 0 and self.loop.time() < deadline:
                await asyncio.sleep(0.02)
        assert self.server is not None
        self.server.should_exit = True

    def on_engine_dead(self, error: EngineDeadError) -> None:
        self.exit_code = 1
        self._spawn(self._exit_after_engine_death())

    async def _exit_after_engine_death(self) -> None:
        await asyncio.sleep(DEAD_ENGINE_LINGER_S)
        deadline = self.loop.time() + 5.0
        while self.state.num_inflight > 0 and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        logger.error("engine core is dead: the server exits")
        assert self.server is not None
        self.server.should_exit = True


async def serve(engine_args: Any, settings: ServerSettings, host: str, port: int,
                log_level: str = "info", spawned: SpawnedEngineCore | None = None) -> int:
    metrics = ServerMetrics(settings.served_model_names[0])
    engine = await AsyncLLM.from_engine_args(engine_args, stat_logger=metrics,
                                             engine_timeout_s=settings.engine_timeout or None, spawned=spawned)
    try:
        parsers = OutputParsers.create(engine.tokenizer, settings.tool_call_parser,
                                       settings.enable_auto_tool_choice, settings.reasoning_parser)
        state = ServerState(engine=engine, settings=settings, metrics=metrics, parsers=parsers,
                            loras=LoRAModules(settings.served_model_names, settings.allow_runtime_lora_updating),
                            engine_serves_lora=bool(getattr(engine_args, "enable_lora", False)))
        for spec in settings.lora_modules:  # --lora-modules: a bad adapter stops the start
            try:
                await state.loras.load(engine, spec.name, spec.path, spec.base_model_name)
            except OpenAIError as e:
                raise ValueError(f"--lora-modules {spec.name}={spec.path}: {e.message}") from e
        lifecycle = _Lifecycle(state, asyncio.get_running_loop())
        engine.client.add_dead_listener(lifecycle.on_engine_dead)
        config = uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=2, timeout_keep_alive=5,
                                # Headers up to 4x our limit reach the middleware (431 as JSON).
                                h11_max_incomplete_event_size=4 * MAX_HEADER_BYTES,
                                # A WebSocket's request message is a body: the same limit (close 1009).
                                ws_max_size=settings.max_request_body)
        server = _UvicornServer(config, lifecycle)
        lifecycle.server = server
        logger.info("serving %s on http://%s:%d", settings.served_model_names[0], host, port)
        await server.serve()
        if engine.is_dead:
            lifecycle.exit_code = 1
        elif not server.started:
            lifecycle.exit_code = 1  # e.g. the port is taken
        return lifecycle.exit_code
    finally:
        engine.shutdown()


def run_server(engine_args: Any, settings: ServerSettings, host: str, port: int, log_level: str = "info",
               spawned: SpawnedEngineCore | None = None) -> int:
    return asyncio.run(serve(engine_args, settings, host, port, log_level, spawned))
