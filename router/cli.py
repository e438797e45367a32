"""`pdserve router`: command-line flags and the process entry point."""

from __future__ import annotations

import argparse
import logging
import os

from router.bounds import RequestLimits, limit_fields
from router.config import ADMIN_TOKEN_ENV, RouterConfig
from router.policies import POLICIES
from router.reasoning import REASONING_PARSERS
from router.tools import TOOL_PARSERS

API_KEY_ENV = "PDSERVE_API_KEY"


def add_router_args(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    p.add_argument("--host", default=d.host, help=f"listen address (default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"listen port (default {d.port})")
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="ADDR",
        help="prefill worker gRPC host:port (repeatable; a DNS name resolving to several "
        "addresses is several workers, re-resolved periodically)",
    )
    p.add_argument(
        "--decode", action="append", default=[], metavar="ADDR", help="decode worker, as --prefill"
    )
    policies = sorted(POLICIES)
    p.add_argument("--prefill-policy", choices=policies, default=d.prefill_policy)
    p.add_argument("--decode-policy", choices=policies, default=d.decode_policy)
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"accepted API key(s), comma-separated or repeated (also ${API_KEY_ENV}); "
        "none: no authentication",
    )
    p.add_argument(
        "--admin-token",
        default=None,
        help=f"token of the /admin endpoints (also ${ADMIN_TOKEN_ENV}); none: they are off",
    )
    p.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log request bodies (prompts included) at INFO; off: no prompt or completion "
        "text is logged",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use (default: the model the workers report)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help=f"largest request body; over it: 413 (default {d.max_body_bytes})",
    )
    p.add_argument(
        "--request-timeout", type=float, default=d.request_timeout, help="seconds per request"
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=d.health_interval,
        help="seconds between worker health probes",
    )
    p.add_argument("--health-timeout", type=float, default=d.health_timeout)
    p.add_argument(
        "--health-failure-threshold",
        type=int,
        default=d.health_failure_threshold,
        help="timed-out probes in a row before a live worker is unhealthy (a refused "
        "connection counts at once)",
    )
    p.add_argument(
        "--dns-interval",
        type=float,
        default=d.dns_interval,
        help="seconds between re-resolutions of worker DNS names",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=d.max_concurrent_requests,
        help="requests in flight before answering 429 (0: no limit)",
    )
    p.add_argument(
        "--max-concurrent-requests-per-key",
        type=int,
        default=d.max_concurrent_requests_per_key,
        help="requests in flight per API key before answering it 429 (0: no limit)",
    )
    p.add_argument(
        "--max-retries",
        type=int,
        default=d.max_retries,
        help="other pairs to try when a worker fails before the first token",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="return a reasoning model's <think>...</think> as `reasoning` / "
        f"`reasoning_content` apart from `content` in chat completions: one of "
        f"{', '.join(sorted(REASONING_PARSERS))} (default: none)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="read tool calls out of chat output into `tool_calls`: one of "
        f"{', '.join(sorted(TOOL_PARSERS))} (default: none)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let requests with tools use tool_choice "auto" (the default with tools); '
        "needs --tool-call-parser",
    )
    bounds = p.add_argument_group("request limits (over one: a 400 naming the field)")
    for name, default, text in limit_fields():
        bounds.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=default,
            metavar="N",
            help=f"{text} (default {default})",
        )
    tls = p.add_argument_group("TLS to the workers (off: plaintext gRPC)")
    tls.add_argument(
        "--worker-tls-ca-file",
        default=None,
        metavar="PEM",
        help="verify workers' certificates against this CA bundle (turns TLS on)",
    )
    tls.add_argument(
        "--worker-tls-cert-file",
        default=None,
        metavar="PEM",
        help="client certificate presented to workers that require one (mutual TLS; "
        "turns TLS on; without --worker-tls-ca-file the system's root CAs verify workers)",
    )
    tls.add_argument("--worker-tls-key-file", default=None, metavar="PEM", help="its private key")
    tls.add_argument(
        "--worker-tls-server-name",
        default=None,
        metavar="NAME",
        help="the name workers' certificates carry, when it is not the host dialed (workers "
        "found through DNS are dialed by IP)",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=d.api_server_count,
        metavar="N",
        help="HTTP server processes sharing the port (one streams about 16k tokens/s); "
        "with N > 1 metrics and concurrency limits are summed over them, and the /admin "
        f"endpoints are off (default {d.api_server_count})",
    )
    p.add_argument(
        "--log-level",
        default="info",
        type=str.lower,  # DEBUG or debug: Python's names in either case
        choices=["debug", "info", "warning", "error", "critical"],
        help="the router's log level (default info)",
    )


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    keys = list(args.api_key) or [os.environ.get(API_KEY_ENV, "")]
    api_keys = tuple(k.strip() for arg in keys for k in arg.split(",") if k.strip())
    return RouterConfig(
        host=args.host,
        port=args.port,
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        api_keys=api_keys,
        admin_token=args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
        served_model_name=args.served_model_name,
        enable_log_requests=args.enable_log_requests,
        max_body_bytes=args.max_body_bytes,
        limits=RequestLimits(**{name: getattr(args, name) for name, _, _ in limit_fields()}),
        request_timeout=args.request_timeout,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        health_failure_threshold=args.health_failure_threshold,
        dns_interval=args.dns_interval,
        max_concurrent_requests=args.max_concurrent_requests,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        max_retries=args.max_retries,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        worker_tls_ca_file=args.worker_tls_ca_file,
        worker_tls_cert_file=args.worker_tls_cert_file,
        worker_tls_key_file=args.worker_tls_key_file,
        worker_tls_server_name=args.worker_tls_server_name,
        api_server_count=args.api_server_count,
    )


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM. Raises ValueError for a bad configuration."""
    from aiohttp import web

    from router.app import create_app, freeze_heap_on_startup

    config = config_from_args(args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("pdserve.router").info(
        "router on %s:%d, prefill %s (%s), decode %s (%s)",
        config.host,
        config.port,
        list(config.prefill) or "none: decode workers prefill locally (colocated)",
        config.prefill_policy,
        list(config.decode),
        config.decode_policy,
    )
    if config.worker_tls:
        logging.getLogger("pdserve.router").info(
            "gRPC to workers over TLS%s",
            ", with a client certificate" if config.worker_tls_cert_file else "",
        )
    if config.api_server_count > 1:
        from router.api_servers import run_api_servers

        return run_api_servers(config, args.log_level)
    app = create_app(config)
    app.on_startup.append(freeze_heap_on_startup)
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        handler_cancellation=True,  # a client that goes away cancels its worker requests
        access_log=None,
        print=None,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve router", description=__doc__)
    add_router_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_router(args)
    except ValueError as e:
        parser.error(str(e))
        return 2
