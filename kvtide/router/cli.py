"""`kvtide router`: one OpenAI-compatible endpoint in front of many backends.

    kvtide router --backends http://127.0.0.1:8001,http://127.0.0.1:8002 --policy cache_aware
    kvtide router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002,http://127.0.0.1:8003

Routes: POST /v1/completions and /v1/chat/completions (relayed, streams chunk by chunk), GET
/v1/models (from a healthy backend), GET /health (200 while a backend is healthy, else 503), GET
/metrics (the router's own kvtide_router_* metrics). Each request carries X-Request-Id to the
backend and back (rtr-<uuid> when the client sent none).

Backends failing GET /health (connection error, timeout, non-200) or a connection take no new
requests until /health answers 200 again. A request that meets a connection error or a 503 (a
draining `kvtide serve`) before the client got a byte is retried on another backend.

SIGTERM/SIGINT: stop accepting connections (new ones are refused), let the requests in flight
finish (streams to their [DONE]) for at most --shutdown-timeout seconds, cut those still running
then, exit 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
from types import FrameType
from typing import Any

from kvtide.router.config import (
    DEFAULT_BALANCE_THRESHOLD,
    DEFAULT_CACHE_THRESHOLD,
    DEFAULT_HEALTH_CHECK_INTERVAL_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    HEALTH_CHECK_TIMEOUT_S,
    POLICIES,
    RouterSettings,
    parse_backend_list,
)


def _urls(flag: str):
    def parse(text: str) -> list[str]:
        try:
            return parse_backend_list(text, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag}: ")) from e

    parse.__name__ = "URL list"  # argparse names the type in its messages
    return parse


def register(subparsers) -> None:
    p = subparsers.add_parser("router", help="route OpenAI requests across several backends",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=_urls("--backends"), default=[], metavar="URL,URL,...",
                   help="backends that serve whole requests (comma-separated http(s)://HOST:PORT)")
    p.add_argument("--prefill", type=_urls("--prefill"), default=[], metavar="URL,URL,...",
                   help="prefill pool (needs --decode): each request first runs there with max_tokens 1")
    p.add_argument("--decode", type=_urls("--decode"), default=[], metavar="URL,URL,...",
                   help="decode pool (needs --prefill); --backends, if given too, join it")
    p.add_argument("--policy", default="cache_aware", choices=POLICIES,
                   help="round_robin: in turn; least_load: fewest requests in flight from this router; "
                        "cache_aware: the backend that was sent the longest prefix of the prompt, within the "
                        "limits below, else least_load (default: %(default)s)")
    p.add_argument("--cache-threshold", type=float, default=DEFAULT_CACHE_THRESHOLD,
                   help="cache_aware: follow a prefix match only when it covers at least this share of the "
                        "prompt's characters (default: %(default)s)")
    p.add_argument("--balance-threshold", type=int, default=DEFAULT_BALANCE_THRESHOLD,
                   help="cache_aware: follow a prefix match only when that backend has at most this many more "
                        "requests in flight (from this router) than the least-loaded healthy backend; "
                        "otherwise the least-loaded one takes it (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--health-check-interval", type=float, default=DEFAULT_HEALTH_CHECK_INTERVAL_S,
                   help=f"seconds between GET /health rounds (each times out after {HEALTH_CHECK_TIMEOUT_S:g} s) "
                        "(default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="seconds a backend may take to answer (streams: between chunks) (default: %(default)s)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route but /health "
                        "(default: $KVTIDE_API_KEY)")
    p.add_argument("--api-keys-file", default=None,
                   help="per-key quotas (kvtide.server.quotas' file format); not with --api-key")
    p.add_argument("--backend-api-key", default=None,
                   help="send 'Authorization: Bearer KEY' to the backends (default: the client's header as is)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight (new connections are refused meanwhile); "
                        "those still running then are cut off (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_router)


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    settings = RouterSettings(backends=args.backends, prefill=args.prefill, decode=args.decode, policy=args.policy,
                              health_check_interval=args.health_check_interval, request_timeout=args.request_timeout,
                              cache_threshold=args.cache_threshold, balance_threshold=args.balance_threshold,
                              api_key=args.api_key or os.environ.get("KVTIDE_API_KEY") or None,
                              api_keys_file=args.api_keys_file,
                              backend_api_key=args.backend_api_key)
    settings.check()
    if settings.api_key and settings.api_keys_file:
        raise ValueError("give --api-key or --api-keys-file, not both")
    return settings


def run_router(args: argparse.Namespace) -> int:
    from kvtide.router.app import build_app

    settings = settings_from_args(args)
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    _check_port_free(args.host, args.port)
    app = build_app(settings)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per upstream call otherwise
    return _serve(app, args.host, args.port, args.log_level, args.shutdown_timeout)


def _serve(app: Any, host: str, port: int, log_level: str, shutdown_timeout: float) -> int:
    """uvicorn until SIGTERM/SIGINT, then its graceful shutdown: listening sockets closed, requests
    in flight waited for (at most shutdown_timeout, then cancelled), the app's lifespan ended."""
    import uvicorn

    logger = logging.getLogger("kvtide.router")

    class DrainingServer(uvicorn.Server):
        # Not appended to _captured_signals, unlike uvicorn's own: it would re-raise the signal at
        # exit (exit status -15), and SIGTERM is how a router is normally stopped.
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit:
                logger.warning("second %s: stopping now", signal.Signals(sig).name)
                self.force_exit = True
                return
            logger.info("%s: draining (new connections refused; requests in flight get at most %g s)",
                        signal.Signals(sig).name, shutdown_timeout)
            self.should_exit = True

    # No access log: it adds a line per request and nothing the metrics do not say.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout)
    server = DrainingServer(config)
    server.run()
    return 0 if server.started else 1


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e})") from e
