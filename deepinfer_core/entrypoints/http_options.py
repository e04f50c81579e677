"""The HTTP server's settings a command line needs, without the server: the environment variables of
the API and instance keys, the HTTP limits (`HttpLimits`, their defaults and options). Nothing here
imports FastAPI or uvicorn, so `deepinfer serve --help` and `deepinfer router --help` answer without
loading the server (`limits.py` enforces the limits; `auth.py` checks the keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

API_KEY_ENV = "DEEPINFER_API_KEY"
"""The API key's environment variable (`--api-key`'s default)."""
PD_SECRET_ENV = "DEEPINFER_PD_SECRET"
"""The instance key's environment variable, shared by the router and its prefill and decode instances."""

HEALTH_INTERVAL_S = 2.0
"""Seconds between the router's health checks of its instances (`deepinfer router --health-interval`)."""

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_BODY_READ_TIMEOUT_S = 60.0
DEFAULT_LIMIT_CONCURRENCY = 1024
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5
DEFAULT_HEADER_READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP server's limits (see the module docstring); `deepinfer serve` options set them."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Larger request bodies are answered 413."""
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    """Seconds a request body may take to arrive whole; then 408."""
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY
    """Most connections and tasks served at once (uvicorn answers 503 beyond); None: no cap."""
    timeout_keep_alive_s: int = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    """Seconds an idle keep-alive connection stays open."""
    header_read_timeout_s: float = DEFAULT_HEADER_READ_TIMEOUT_S
    """Seconds a request's headers may take to arrive whole; then the connection is closed."""

    def __post_init__(self) -> None:
        if (self.max_body_bytes <= 0 or self.body_read_timeout_s <= 0 or self.timeout_keep_alive_s <= 0
                or self.header_read_timeout_s <= 0):
            raise ValueError(f"HTTP limits must be positive, got {self}")
        if self.limit_concurrency is not None and self.limit_concurrency <= 0:
            raise ValueError(f"limit_concurrency must be positive or None, got {self.limit_concurrency}")

    def uvicorn_options(self) -> dict[str, Any]:
        """Keyword arguments for `uvicorn.Config`."""
        return {"limit_concurrency": self.limit_concurrency, "timeout_keep_alive": self.timeout_keep_alive_s,
                "http": _bounded_headers_protocol(self.header_read_timeout_s)}


def add_http_limit_arguments(parser: Any) -> None:
    """The HTTP limits' command-line options (`http_limits_from` reads them back)."""
    group = parser.add_argument_group("HTTP limits")
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES})")
    group.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT_S,
                       help=f"seconds a request body may take to arrive, then 408 (default {DEFAULT_BODY_READ_TIMEOUT_S:g})")
    group.add_argument("--header-read-timeout", type=float, default=DEFAULT_HEADER_READ_TIMEOUT_S,
                       help="seconds a request's headers may take to arrive, then the connection is closed "
                            f"(default {DEFAULT_HEADER_READ_TIMEOUT_S:g})")
    group.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                       help=f"most connections served at once, 503 beyond (default {DEFAULT_LIMIT_CONCURRENCY})")
    group.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                       help=f"seconds an idle keep-alive connection stays open (default {DEFAULT_TIMEOUT_KEEP_ALIVE_S})")


def http_limits_from(args: Any) -> HttpLimits:
    """The HTTP limits `add_http_limit_arguments`' options ask for."""
    return HttpLimits(max_body_bytes=args.max_body_bytes, body_read_timeout_s=args.body_read_timeout,
                      limit_concurrency=args.limit_concurrency, timeout_keep_alive_s=args.timeout_keep_alive,
                      header_read_timeout_s=args.header_read_timeout)


def _bounded_headers_protocol(timeout_s: float) -> type:
    from deepinfer_core.entrypoints.limits import bounded_headers_protocol  # uvicorn: only when serving

    return bounded_headers_protocol(timeout_s)
