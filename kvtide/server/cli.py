"""`kvtide serve MODEL`: the OpenAI-compatible server.

    kvtide serve smollm2 --port 8000          # then open http://127.0.0.1:8000/ for the chat page
    kvtide serve path/to/model.Q4_K_M.gguf
    kvtide serve ./my-llama --served-model-name llama --api-key sk-... --max-model-len 4096
    kvtide serve ./my-llama --data-parallel-size 2     # two engine replicas, requests balanced
    # Multi-node: ranks 0-1 and the API on the head (10.0.0.1), ranks 2-3 on a headless node,
    # both with the same $KVTIDE_DP_SECRET (joins and the replicas' traffic are authenticated with it)
    kvtide serve ./my-llama --data-parallel-size 4 --data-parallel-size-local 2 --data-parallel-address 10.0.0.1
    kvtide serve ./my-llama --headless --data-parallel-size 4 --data-parallel-size-local 2
        --data-parallel-start-rank 2 --data-parallel-address 10.0.0.1
    kvtide serve ./my-llama --api-keys-file keys.json  # per-key keys and limits (below)

/v1/chat/completions and /v1/completions also answer WebSockets on the same paths: send the POST's
JSON body as one text message; each SSE event's JSON comes back as one message, then "[DONE]".

--api-keys-file is JSON, each limit optional (absent or null: unlimited), per minute over a
sliding 60 s window; name labels the key's metrics (kvtide:quota_requests_total{key_name,
outcome}, kvtide:quota_tokens_total, kvtide:quota_inflight; default: a hash prefix, never the key):

    {"keys": [{"key": "sk-a", "name": "team-a", "requests_per_minute": 60,
               "tokens_per_minute": 100000, "max_concurrent": 4},
              {"key": "sk-b"}]}

Engine flags are EngineArgs' (vLLM's names); the server's own are below.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from kvtide.engine.chat_template import read_chat_template
from kvtide.engine.core_client import DEFAULT_ENGINE_TIMEOUT_S, spawn_engine_core
from kvtide.engine.dp_client import check_data_parallel_args
from kvtide.engine_args import EngineArgs
from kvtide.reasoning import REASONING_PARSERS
from kvtide.server import limits
from kvtide.server.limits import DEFAULT_MAX_REQUEST_BODY
from kvtide.server.openai.batches.settings import add_batch_args, batch_settings_from_args
from kvtide.server.output_parsers import check_flags
from kvtide.sizes import parse_size
from kvtide.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from kvtide.server.quotas import ApiKeys


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description=__doc__, epilog=limits.describe(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory, GGUF file, Hugging Face hub id, 'smollm2' or 'demo'")
    p.add_argument("--model", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and the chat "
                        "page GET / (default: $KVTIDE_API_KEY)")
    p.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="JSON file of API keys, each with optional requests_per_minute, tokens_per_minute "
                        "and max_concurrent limits (format above); over a limit: 429 with Retry-After. "
                        "With --api-key too, a request passes with either, and --api-key's key has no "
                        "limits. Checked before the model loads")
    p.add_argument("--allowed-origins", nargs="+", action="extend", default=None, metavar="ORIGIN",
                   help="web pages (scheme://host[:port], a JSON list or several values; '*' for any) that "
                        "may open a WebSocket besides same-origin and loopback pages (the default); others "
                        "get 403. Browsers only: clients that send no Origin are not checked")
    p.add_argument("--allowed-hosts", nargs="+", action="extend", default=None, metavar="HOST",
                   help="Host header names (no port; '*.example.com' for subdomains; '*' for any) the server "
                        "answers; others get 400 (against DNS rebinding). Default: bound to a loopback "
                        "address, localhost, 127.0.0.1 and [::1] only; otherwise any")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: MODEL)")
    p.add_argument("--chat-template", default=None,
                   help="chat template file or Jinja string overriding the tokenizer's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat request's own chat_template (400 without this flag: a template is code "
                        "the server runs); it renders sandboxed, within --render-timeout and an output cap")
    p.add_argument("--render-timeout", type=float, default=limits.DEFAULT_RENDER_TIMEOUT_S,
                   help="seconds a chat template may render (400 past it) and a prompt may wait for the "
                        "tokenizer (503), both off the event loop")
    p.add_argument("--max-prompts-per-request", type=int, default=limits.DEFAULT_MAX_PROMPTS_PER_REQUEST,
                   help="completions one /v1/completions request may ask for, prompts x n (400 past it)")
    p.add_argument("--max-tools-per-request", type=int, default=limits.DEFAULT_MAX_TOOLS,
                   help="tools per chat request (400 past it): each is rendered into the prompt and, for a "
                        "named or \"required\" tool_choice, compiled into the output grammar")
    p.add_argument("--max-tools-bytes", default=str(limits.DEFAULT_MAX_TOOLS_BYTES),
                   help="JSON bytes of a request's tool definitions together, or with a unit ('128KiB'); "
                        "400 past it")
    p.add_argument("--max-request-body", default=str(DEFAULT_MAX_REQUEST_BODY),
                   help="largest request body in bytes or with a unit ('4MiB'); larger gets 413")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight; those still running then end "
                        "with an error")
    p.add_argument("--engine-timeout", type=float, default=DEFAULT_ENGINE_TIMEOUT_S,
                   help="seconds the engine core may stay silent (a stopped or wedged process) before "
                        "it is declared dead: requests in flight fail, /health turns 503, the server "
                        "exits; must exceed the longest step; 0 disables")
    p.add_argument("--enable-admin-api", action="store_true",
                   help="serve admin routes (POST /reset_prefix_cache); without it they are 404. "
                        "They need --admin-api-key's key when it is set, else the API key like every route")
    p.add_argument("--admin-api-key", default=None,
                   help="the key of the admin routes and of /internal/* (engine stats and integrity "
                        "checks, 404 without this key); no client key (--api-key, --api-keys-file) opens "
                        "them unless it is this one (default: $KVTIDE_ADMIN_API_KEY)")
    p.add_argument("--no-ui", dest="enable_ui", action="store_false",
                   help="do not serve the chat page at GET / (then 404 like any unknown route); the page "
                        "loads without --api-key's key and asks for it before calling the API")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (the default when a request has tools): the model decides '
                        "whether to call, and --tool-call-parser finds the calls in its text")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format, for tool_choice \"auto\" (named and \"required\" "
                        "choices need no parser: the output is constrained to the calls' JSON)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="the model's reasoning format: chat responses carry the <think> section as "
                        "reasoning_content, and structured output constrains only the answer after it")
    p.add_argument("--disable-response-storage", action="store_true",
                   help="keep no /v1/responses answers in memory (store: true is then ignored, GET "
                        "/v1/responses/{id} and previous_response_id find nothing)")
    p.add_argument("--headless", action="store_true",
                   help="serve no API: run this node's data-parallel replicas (--data-parallel-size-local "
                        "of them, from --data-parallel-start-rank) for the head at --data-parallel-address / "
                        "--data-parallel-rpc-port (with the head's $KVTIDE_DP_SECRET); exits when the head "
                        "shuts them down or goes away")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served by name, as name=path or a JSON object "
                        '{"name", "path", "base_model_name"}; a request picks one by its model field (needs --enable-lora)')
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; needs --enable-lora)")
    add_batch_args(p)
    EngineArgs.add_cli_args(p, skip=("model",))
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    if not model:
        raise ValueError("give the model: kvtide serve MODEL (a directory, GGUF file, hub id, 'smollm2' or 'demo')")
    engine_args = EngineArgs.from_cli_args(args).replace(model=model)
    if args.headless:
        return _run_headless(engine_args, args.log_level)
    max_body = parse_size(args.max_request_body, "--max-request-body")
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    if args.engine_timeout < 0:
        raise ValueError("--engine-timeout must be >= 0 (0 disables the watchdog)")
    check_flags(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser)
    check_data_parallel_args(engine_args)
    lora_modules, allow_lora_updates = _lora_flags(args, engine_args)
    _check_port_free(args.host, args.port)
    engine_args.check_local_checkpoint()  # a broken checkpoint: refused now, not once the engine loaded it
    api_key = args.api_key or os.environ.get("KVTIDE_API_KEY") or None
    api_keys = _load_api_keys(args.api_keys_file, api_key)
    admin_api_key = args.admin_api_key or os.environ.get("KVTIDE_ADMIN_API_KEY") or None
    if admin_api_key is not None and api_keys is not None and api_keys.lookup(admin_api_key) is not None \
            and admin_api_key != api_key:
        raise ValueError(f"--admin-api-key is a key of --api-keys-file {args.api_keys_file}: its holder "
                         f"would be an admin; give the admin a key of its own")
    chat_template = read_chat_template(args.chat_template)
    request_limits = _request_limits(args, max_body)
    allowed_origins, allowed_hosts = _browser_flags(args)
    batch_settings = batch_settings_from_args(args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("KVTIDE_LOG_LEVEL", args.log_level.upper())
    # Every flag is checked: the engine core starts now, and imports torch and loads the model while
    # this process imports its web stack and the tokenizer.
    spawned = spawn_engine_core(engine_args) if engine_args.data_parallel_size == 1 else None
    try:
        from kvtide.server.api_server import run_server
        from kvtide.server.state import ServerSettings

        settings = ServerSettings(served_model_names=args.served_model_name or [model], api_key=api_key,
                                  api_keys=api_keys, chat_template=chat_template, request_limits=request_limits,
                                  max_request_body=max_body, shutdown_timeout=args.shutdown_timeout,
                                  engine_timeout=args.engine_timeout, enable_admin_api=args.enable_admin_api,
                                  enable_sleep_mode=args.enable_sleep_mode,
                                  admin_api_key=admin_api_key,
                                  enable_ui=args.enable_ui, enable_auto_tool_choice=args.enable_auto_tool_choice,
                                  tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                                  allowed_origins=allowed_origins, allowed_hosts=allowed_hosts,
                                  lora_modules=lora_modules, allow_runtime_lora_updating=allow_lora_updates)
        settings.batch = batch_settings
    except BaseException:
        if spawned is not None:
            spawned.kill()
        raise
    if settings.enable_sleep_mode and settings.api_key is None and settings.admin_api_key is None:
        logging.getLogger("kvtide.server").warning(
            "--enable-sleep-mode without --api-key: anyone who reaches this port can put the engine to sleep "
            "or load other weights")
    settings.enable_response_storage = not args.disable_response_storage
    if settings.enable_admin_api and settings.api_key is None and settings.admin_api_key is None:
        logging.getLogger("kvtide.server").warning(
            "--enable-admin-api without --api-key: anyone who reaches this port can reset the prefix cache")
    exit_code = run_server(engine_args, settings, args.host, args.port, args.log_level, spawned)
    # Everything is stopped and flushed; the interpreter's teardown of torch and transformers
    # modules would only add seconds to every restart.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _lora_flags(args: argparse.Namespace, engine_args: EngineArgs) -> tuple[list, bool]:
    """--lora-modules parsed, and whether runtime adapter updates are allowed; both need --enable-lora."""
    from kvtide.server.openai.lora.modules import parse_lora_modules, runtime_updating_allowed

    modules = parse_lora_modules(args.lora_modules)
    allowed = runtime_updating_allowed(args.allow_runtime_lora_updating)
    if (modules or args.allow_runtime_lora_updating) and not engine_args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    return modules, allowed


def _run_headless(engine_args: EngineArgs, log_level: str) -> int:
    from kvtide.engine.dp_remote import run_headless

    check_data_parallel_args(engine_args, headless=True)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("KVTIDE_LOG_LEVEL", log_level.upper())
    return run_headless(engine_args)


def _request_limits(args: argparse.Namespace, max_body: int) -> limits.RequestLimits:
    if args.render_timeout <= 0:
        raise ValueError("--render-timeout must be > 0")
    for flag, value in (("--max-prompts-per-request", args.max_prompts_per_request),
                        ("--max-tools-per-request", args.max_tools_per_request)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1")
    return limits.RequestLimits(max_prompts_per_request=args.max_prompts_per_request,
                                max_tools=args.max_tools_per_request,
                                max_tools_bytes=parse_size(args.max_tools_bytes, "--max-tools-bytes"),
                                max_request_body=max_body, render_timeout_s=args.render_timeout,
                                trust_request_chat_template=args.trust_request_chat_template)


API_KEY_NAME = "--api-key"
"""key_name of --api-key's key in the quota metrics when --api-keys-file is given too."""


def _load_api_keys(path: str | None, api_key: str | None) -> ApiKeys | None:
    """--api-keys-file, with --api-key's key added without limits; ValueError (exit 2) if bad."""
    if path is None:
        return None
    from kvtide.server.quotas import load_api_keys

    api_keys = load_api_keys(path)
    if api_key is None:
        return api_keys
    if api_keys.lookup(api_key) is not None:
        raise ValueError(f"--api-key is also a key of --api-keys-file {path}: drop one of them")
    if API_KEY_NAME in api_keys.names:
        raise ValueError(f"--api-keys-file {path}: the name {API_KEY_NAME!r} is reserved for --api-key's key")
    return api_keys.with_key(api_key, API_KEY_NAME)


def _browser_flags(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """--allowed-origins and --allowed-hosts, checked; the hosts default to loopback names when
    the server binds a loopback address."""
    from kvtide.server.browser_policy import ANY, default_allowed_hosts, normalize_origin, parse_list_flag

    try:
        origins = [normalize_origin(o) for o in parse_list_flag(args.allowed_origins)]
        hosts = parse_list_flag(args.allowed_hosts)
    except ValueError as e:
        raise ValueError(f"--allowed-origins/--allowed-hosts: {e}") from None
    if args.allowed_hosts is None:
        return origins, default_allowed_hosts(args.host)
    return origins, None if ANY in hosts else hosts


def _check_port_free(host: str, port: int) -> None:
    """Fail in a second, not after the model loaded, when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick a free port with "
                             f"--port or stop the process that holds it") from e
