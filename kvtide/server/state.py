"""ServerState: what every route needs, hung on `app.state.kvtide`."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvtide import LoRARequest
from kvtide.engine.async_llm import AsyncLLM
from kvtide.engine.core_client import DEFAULT_ENGINE_TIMEOUT_S
from kvtide.server.errors import OpenAIError
from kvtide.server.limits import DEFAULT_MAX_REQUEST_BODY, RequestLimits
from kvtide.server.metrics import ServerMetrics
from kvtide.server.openai.batches.settings import BatchSettings
from kvtide.server.openai.lora.modules import LoRAModules, LoRAModuleSpec
from kvtide.server.openai.responses.store import ResponseStore
from kvtide.server.output_parsers import OutputParsers

if TYPE_CHECKING:
    from kvtide.server.quotas import ApiKeys


@dataclass
class ServerSettings:
    """The server's own flags (the engine's live in EngineArgs)."""

    served_model_names: list[str]
    """Names /v1/models lists and requests may ask for; the first is the one reported."""
    api_key: str | None = None
    """--api-key: passes every check (and no quota), alone or along --api-keys-file."""
    api_keys: ApiKeys | None = None
    """--api-keys-file: the keys QuotaMiddleware admits, each with its limits (server/quotas.py)."""
    chat_template: str | None = None
    """A Jinja template overriding the tokenizer's (already read from a file if one was given)."""
    max_request_body: int = DEFAULT_MAX_REQUEST_BODY
    """Bytes; larger bodies get 413."""
    shutdown_timeout: float = 30.0
    """Seconds SIGTERM waits for requests in flight; those still running then end with an error."""
    engine_timeout: float = DEFAULT_ENGINE_TIMEOUT_S
    """Watchdog: an engine core silent this many seconds is declared dead (0: never)."""
    enable_admin_api: bool = False
    enable_sleep_mode: bool = False
    """Serve the sleep-mode routes (server/sleep_mode.py); the engine was started to allow them."""
    """Serve the admin routes (POST /reset_prefix_cache); off, they are 404. --api-key still applies."""
    admin_api_key: str | None = None
    """--admin-api-key: the only key of /internal/* (404 without one) and, when set, of the admin routes."""
    enable_ui: bool = True
    """Serve the chat page at GET / (open without the API key: it holds no secret); off, / is 404."""
    enable_auto_tool_choice: bool = False
    """Allow tool_choice "auto" (needs tool_call_parser)."""
    tool_call_parser: str | None = None
    """The model's tool-call format (kvtide.tool_parsers), for tool_choice "auto"."""
    reasoning_parser: str | None = None
    """The model's reasoning convention (kvtide.reasoning): responses get reasoning_content."""
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    """Per-request work limits the flags set (server/limits.py); the rest are constants there."""
    allowed_origins: list[str] = field(default_factory=list)
    """--allowed-origins: pages that may open a WebSocket besides same-origin and loopback ones
    ("*": any); see server/browser_policy.py."""
    allowed_hosts: list[str] | None = None
    """Host header names accepted (None: any); `kvtide serve` bound to loopback: loopback names."""
    lora_modules: list[LoRAModuleSpec] = field(default_factory=list)
    """--lora-modules: adapters loaded at start, each served under its name."""
    allow_runtime_lora_updating: bool = False
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served (else 404)."""
    enable_response_storage: bool = True
    """Keep /v1/responses answers asked to be stored (off: --disable-response-storage, and then
    GET and previous_response_id find nothing)."""
    batch: BatchSettings = field(default_factory=BatchSettings)
    """/v1/files and /v1/batches: where files live, their limits, batch lines in flight."""


@dataclass
class ServerState:
    engine: AsyncLLM
    settings: ServerSettings
    metrics: ServerMetrics
    parsers: OutputParsers = field(default_factory=OutputParsers)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    """SIGTERM received: new requests get 503, those in flight finish."""
    sleep_level: int = 0
    """The engine's sleep level as the sleep routes last saw it (server/sleep_mode.py); 0 awake."""
    num_inflight: int = 0
    """HTTP requests and WebSockets being served (not counting /health and /metrics)."""
    loras: LoRAModules = field(default_factory=lambda: LoRAModules([]))
    """The LoRA adapters served by name (server/openai/lora/modules.py)."""
    engine_serves_lora: bool = False
    """The engine was started with --enable-lora."""
    response_store: ResponseStore = field(default_factory=ResponseStore)
    """/v1/responses answers kept for GET and previous_response_id (openai/responses/store.py)."""

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def limits(self) -> RequestLimits:
        return self.settings.request_limits

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def unavailable_reason(self) -> str | None:
        if self.engine.is_dead:
            return "the engine is dead"
        if self.draining:
            return "the server is shutting down"
        return None

    def check_model(self, model: str | None) -> str:
        """The model name to report for a request naming `model` (None: the default); 404 if unknown."""
        if model is None or model in self.settings.served_model_names:
            return self.model_name
        if self.loras.get(model) is not None:
            return model
        raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request naming `model` runs with (None: the base model)."""
        return self.loras.get(model)

    @functools.cached_property
    def token_text(self):
        """token id -> its text alone (for logprobs), cached."""
        tokenizer = self.tokenizer

        @functools.lru_cache(maxsize=1 << 16)
        def decode(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        return decode


def get_state(request: Request) -> ServerState:
    return request.app.state.kvtide
