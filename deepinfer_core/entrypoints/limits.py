"""What one client may cost the server: body size and read time, connections, prompt length.

- A body larger than `max_body_bytes` is answered 413 without reading the rest.
- A body that does not arrive whole within `body_read_timeout_s` of the request's start is answered
  408 and its connection closed, so a client that stops sending mid-body holds nothing for long.
- uvicorn caps the connections and tasks it serves at once (`limit_concurrency`, answered 503 beyond)
  and closes idle keep-alive connections after `timeout_keep_alive_s`.
- A connection whose request headers do not arrive whole within `header_read_timeout_s` (of the
  connection's start, or of the last response on it) is closed: uvicorn has no such timeout, so its h11
  protocol is served with one (`BoundedHeadersH11`), and a client trickling headers holds nothing long.
- A prompt whose text is longer in bytes than the context could hold is rejected before it is
  tokenized (`max_prompt_bytes`): no token of the vocabulary is longer than its longest entry.
- After a request whose body was large (`TRIM_AFTER_BYTES`), and when the server falls idle after
  `TRIM_AFTER_REQUESTS` requests or more since the last trim, the C heap is trimmed (glibc's
  `malloc_trim`), so memory a burst of large bodies or of streams took returns to the system instead of
  staying in the allocator's per-thread arenas (RSS stayed +0.9 GiB after 200 streams without it).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from deepinfer_core.chat_contract import Api, ApiError
from deepinfer_core.entrypoints.http_options import (  # noqa: F401 -- the limits' settings, importable here too
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_HEADER_READ_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    HttpLimits,
    add_http_limit_arguments,
    http_limits_from,
)

TRIM_AFTER_BYTES = 1024 * 1024
TRIM_AFTER_REQUESTS = 64
"""Requests answered since the last trim that make the server trim when it next has none in flight."""
TRIM_DELAY_S = 0.2


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


def bounded_headers_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than `timeout_s`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedHeadersH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # this request's headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets its own deadline

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return BoundedHeadersH11


async def read_body(request: Request, limits: HttpLimits, api: Api) -> bytes:
    """The whole request body, within `limits`.

    :raises ApiError: 413 for a body over `max_body_bytes`, 408 for one slower than `body_read_timeout_s`.
    :raises ClientGone: the client disconnected mid-body.
    """
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError.from_message(413, f"Request body is larger than {limit} bytes.", api)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_read_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError.from_message(413, f"Request body is larger than {limit} bytes.", api)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError.from_message(
            408, f"The request body did not arrive within {limits.body_read_timeout_s:g} s.", api) from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def max_token_bytes_of(tokenizer: Any) -> int | None:
    """Bytes of the longest vocabulary entry: the tokenizer's own `max_token_bytes`, else the UTF-8
    length of the longest entry (an upper bound for byte-level BPE, whose entries spell one byte a
    character); None when the tokenizer does not expose its vocabulary."""
    known = getattr(tokenizer, "max_token_bytes", None)
    if isinstance(known, int):
        return known
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not hasattr(hf, "get_vocab"):
        return None
    return max((len(token.encode("utf-8")) for token in hf.get_vocab(with_added_tokens=True)), default=None)


def max_prompt_bytes(context_limit: int, max_token_bytes: int) -> int:
    """Longest prompt text, in UTF-8 bytes, that could still fit `context_limit` tokens."""
    return context_limit * max_token_bytes


def check_prompt_bytes(text: str, context_limit: int, max_token_bytes: int | None, api: Api) -> None:
    """Reject `text` when even the longest tokens could not fit it in the context (no tokenization).

    :raises ApiError: 400, in `api`'s shape.
    """
    if max_token_bytes is None:
        return
    bound = max_prompt_bytes(context_limit, max_token_bytes)
    # Each character is at most 4 bytes: most texts are decided without encoding them.
    if len(text) * 4 <= bound or len(text) <= bound and len(text.encode("utf-8", "surrogatepass")) <= bound:
        return
    raise ApiError.from_message(
        400, f"This model's maximum context length is {context_limit} tokens; the prompt is longer than "
        f"{bound} bytes, more than that many tokens could hold. Shorten the prompt.", api)


__all__ = [
    "DEFAULT_BODY_READ_TIMEOUT_S", "DEFAULT_LIMIT_CONCURRENCY", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_TIMEOUT_KEEP_ALIVE_S",
    "ClientGone", "HttpLimits", "add_http_limit_arguments", "check_prompt_bytes", "http_limits_from", "max_prompt_bytes",
    "max_token_bytes_of", "read_body",
]


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class TrimHeap:
    """ASGI middleware: trim the heap once a request with a body over `TRIM_AFTER_BYTES` is answered, and
    once the last request in flight is answered when `TRIM_AFTER_REQUESTS` or more were since the last trim."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.num_in_flight = 0
        self.num_since_trim = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return message

        self.num_in_flight += 1
        try:
            await self.app(scope, counting_receive, send)
        finally:
            self.num_in_flight -= 1
            self.num_since_trim += 1
            is_idle_after_many = self.num_in_flight == 0 and self.num_since_trim >= TRIM_AFTER_REQUESTS
            trim = _malloc_trim()
            if (received > TRIM_AFTER_BYTES or is_idle_after_many) and trim is not None:
                self.num_since_trim = 0
                # a little later: the request's objects are freed only once this call has unwound
                loop = asyncio.get_running_loop()
                loop.call_later(TRIM_DELAY_S, loop.run_in_executor, None, trim, 0)
