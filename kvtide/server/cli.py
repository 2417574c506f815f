"""`kvtide serve MODEL`: the OpenAI-compatible server.

    kvtide serve smollm2 --port 8000          # then open http://127.0.0.1:8000/ for the chat page
    kvtide serve path/to/model.Q4_K_M.gguf
    kvtide serve ./my-llama --served-model-name llama --api-key sk-... --max-model-len 4096
    kvtide serve ./my-llama --data-parallel-size 2     # two engine replicas, requests balanced

Engine flags are EngineArgs' (vLLM's names); the server's own are below.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from kvtide.engine.chat_template import read_chat_template
from kvtide.engine.core_client import DEFAULT_ENGINE_TIMEOUT_S
from kvtide.engine.dp_client import check_data_parallel_args
from kvtide.engine_args import EngineArgs
from kvtide.reasoning import REASONING_PARSERS
from kvtide.server import limits
from kvtide.server.output_parsers import check_flags
from kvtide.server.state import DEFAULT_MAX_REQUEST_BODY
from kvtide.tool_parsers import TOOL_PARSERS


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
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: MODEL)")
    p.add_argument("--chat-template", default=None,
                   help="chat template file or Jinja string overriding the tokenizer's")
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
                        "They need the API key like every route: set --api-key too")
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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    EngineArgs.add_cli_args(p, skip=("model",))
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from kvtide.config import parse_size
    from kvtide.server.api_server import run_server
    from kvtide.server.state import ServerSettings

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    if not model:
        raise ValueError("give the model: kvtide serve MODEL (a directory, GGUF file, hub id, 'smollm2' or 'demo')")
    engine_args = EngineArgs.from_cli_args(args).replace(model=model)
    try:
        max_body = parse_size(args.max_request_body)
    except ValueError as e:
        raise ValueError(f"--max-request-body: cannot parse {args.max_request_body!r}") from e
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    if args.engine_timeout < 0:
        raise ValueError("--engine-timeout must be >= 0 (0 disables the watchdog)")
    check_flags(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser)
    check_data_parallel_args(engine_args)
    _check_port_free(args.host, args.port)
    settings = ServerSettings(served_model_names=args.served_model_name or [model],
                              api_key=args.api_key or os.environ.get("KVTIDE_API_KEY") or None,
                              chat_template=read_chat_template(args.chat_template),
                              max_request_body=max_body, shutdown_timeout=args.shutdown_timeout,
                              engine_timeout=args.engine_timeout, enable_admin_api=args.enable_admin_api,
                              enable_ui=args.enable_ui, enable_auto_tool_choice=args.enable_auto_tool_choice,
                              tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.enable_admin_api and settings.api_key is None:
        logging.getLogger("kvtide.server").warning(
            "--enable-admin-api without --api-key: anyone who reaches this port can reset the prefix cache")
    os.environ.setdefault("KVTIDE_LOG_LEVEL", args.log_level.upper())
    exit_code = run_server(engine_args, settings, args.host, args.port, args.log_level)
    # Everything is stopped and flushed; the interpreter's teardown of torch and transformers
    # modules would only add seconds to every restart.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


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
