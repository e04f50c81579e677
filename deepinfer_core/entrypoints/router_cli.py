"""The `deepinfer router` command: its options, and uvicorn serving the router (`router.py`).

    deepinfer router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

Parsing imports neither FastAPI nor httpx (`deepinfer router --help` answers at once, and without the
`pd` extra); `run_router` does, and without them answers with what to install.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from deepinfer_core.entrypoints.http_options import (
    API_KEY_ENV,
    HEALTH_INTERVAL_S,
    PD_SECRET_ENV,
    add_http_limit_arguments,
    http_limits_from,
)


def add_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `router` subcommand to `deepinfer`'s argument parser."""
    parser = subparsers.add_parser("router", help="route requests to prefill and decode instances",
                                   description="`deepinfer router`: one endpoint in front of prefill and decode "
                                               "instances, speaking the same APIs.")
    parser.add_argument("--prefill", action="append", required=True, help="a prefill instance's base URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, help="a decode instance's base URL (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--health-interval", type=float, default=HEALTH_INTERVAL_S,
                        help="seconds between health checks of the instances (0: none)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"key every /v1 request must present, as `deepinfer serve --api-key` (default: "
                             f"${API_KEY_ENV}); also the instance key unless ${PD_SECRET_ENV} is set")
    add_http_limit_arguments(parser)
    parser.set_defaults(handler=run_router)
    return parser


def run_router(args: argparse.Namespace) -> int:
    """Serve the router with uvicorn, under the HTTP limits the options ask for.

    :raises ModuleNotFoundError: httpx, FastAPI or uvicorn is not installed (the CLI names the extra).
    """
    import httpx  # noqa: F401 -- imported first, so a bare install is told the pd extra, the router's own
    import uvicorn

    from deepinfer_core.entrypoints.router import build_router_app

    limits = http_limits_from(args)
    app = build_router_app(args.prefill, args.decode, args.health_interval, limits=limits, api_key=args.api_key,
                           pd_secret=os.environ.get(PD_SECRET_ENV) or None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", **limits.uvicorn_options())
    return 0


__all__ = ["add_router_parser", "run_router"]
