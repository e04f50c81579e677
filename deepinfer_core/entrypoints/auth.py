"""API keys: with `deepinfer serve --api-key KEY` (or `DEEPINFER_API_KEY`), every `/v1/...` request
must present KEY, as each API's clients send it:

- OpenAI APIs: `Authorization: Bearer KEY` (what the `openai` SDK sends);
- Anthropic Messages (`/v1/messages...`): `x-api-key: KEY` (what the `anthropic` SDK sends), or a
  Bearer token (its `auth_token` option).

Keys are compared in constant time (`hmac.compare_digest`); a missing or wrong key is answered 401 in
the API's error shape. The API's description (`/docs`, `/redoc`, `/openapi.json`) needs the key too
(a Bearer header), so it tells a stranger nothing. `/health` and `/metrics` stay open, as probes and
scrapers expect.

Between the router and prefill/decode instances (`pd.py`), an instance key (`InstanceKey`: the
`DEEPINFER_PD_SECRET` environment variable, else the API key) signs what only the router may send:
the KV transfer handle a decode instance is given, the router's prefill calls, and a decode instance's
read of a handle. Signatures are HMAC-SHA256 over a purpose and the message, compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from deepinfer_core.entrypoints.errors import api_of_path, error_response
from deepinfer_core.entrypoints.http_options import API_KEY_ENV, PD_SECRET_ENV

PROTECTED_PREFIX = "/v1/"
DOCS_PATHS = ("/docs", "/redoc", "/openapi.json")
"""FastAPI's description of the API (and its pages' own sub-paths, such as `/docs/oauth2-redirect`)."""
INSTANCE_AUTH_HEADER = "x-deepinfer-instance-auth"
"""Header carrying an instance key's signature (`InstanceKey.sign`) between the router and instances."""


@dataclass(frozen=True, repr=False)
class InstanceKey:
    """The secret the router and its prefill and decode instances share (never printed)."""

    secret: bytes

    def sign(self, purpose: str, message: str) -> str:
        """HMAC-SHA256 of `message` for `purpose` (a signature for one purpose never passes for another)."""
        return hmac.new(self.secret, f"{purpose}\n{message}".encode(), hashlib.sha256).hexdigest()

    def verify(self, purpose: str, message: str, signature: str | None) -> bool:
        """Whether `signature` is `sign(purpose, message)`, compared in constant time."""
        return signature is not None and hmac.compare_digest(self.sign(purpose, message).encode(),
                                                             signature.encode("utf-8", "replace"))

    def __repr__(self) -> str:
        return "InstanceKey(...)"


def instance_key_of(secret: str | None, api_key: str | None) -> InstanceKey | None:
    """The instance key: `secret` (`DEEPINFER_PD_SECRET`), else the API key, else None."""
    chosen = secret or api_key
    return InstanceKey(chosen.encode()) if chosen else None


def is_protected(path: str) -> bool:
    """Whether a request to `path` must present the API key: the APIs and their description."""
    return path.startswith(PROTECTED_PREFIX) or any(path == p or path.startswith(p + "/") for p in DOCS_PATHS)


def presented_key(headers: Headers, is_anthropic: bool) -> str | None:
    """The key a request presents: its Bearer token, or for Anthropic's API also `x-api-key`."""
    if is_anthropic and "x-api-key" in headers:
        return headers["x-api-key"]
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def is_valid_key(presented: str | None, api_key: str) -> bool:
    """Whether `presented` equals `api_key`, compared in constant time."""
    return presented is not None and hmac.compare_digest(presented.encode(), api_key.encode())


class ApiKeyMiddleware:
    """Answer 401 to `/v1/...` and API-description requests that do not present `api_key`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key is empty; leave --api-key unset to serve without one")
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not is_protected(path):
            await self.app(scope, receive, send)
            return
        api = api_of_path(path)
        if is_valid_key(presented_key(Headers(scope=scope), api == "messages"), self.api_key):
            await self.app(scope, receive, send)
            return
        how = "an x-api-key header" if api == "messages" else "an Authorization: Bearer header"
        response = error_response(401, f"Invalid or missing API key: send the server's key in {how}.", api,
                                  headers={"www-authenticate": "Bearer"} if api != "messages" else None)
        await response(scope, receive, send)


__all__ = ["API_KEY_ENV", "DOCS_PATHS", "INSTANCE_AUTH_HEADER", "PD_SECRET_ENV", "ApiKeyMiddleware", "InstanceKey",
           "instance_key_of", "is_protected", "is_valid_key", "presented_key"]
