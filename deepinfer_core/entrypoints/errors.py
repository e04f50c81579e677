"""Errors the HTTP server answers itself, in the shape of the API the client speaks.

OpenAI clients (Chat Completions, Responses, Completions, models) read `{"error": {...}}`; Anthropic
clients (`/v1/messages...`) read `{"type": "error", "error": {...}}`. Unknown paths (404), wrong
methods (405), missing or wrong API keys (401) and the server's own limits all answer that way, never
with FastAPI's `{"detail": ...}`.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

from deepinfer_core.chat_contract import Api, ApiError

ANTHROPIC_PREFIX = "/v1/messages"
HTTP_MESSAGES = {404: "Not found", 405: "Method not allowed"}


def api_of_path(path: str) -> Api:
    """Whose error shape a request to `path` gets: Anthropic's under `/v1/messages`, else OpenAI's."""
    return "messages" if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/") else "chat"


def error_response(status_code: int, message: str, api: Api, headers: dict[str, str] | None = None) -> Response:
    """A JSON error response in `api`'s shape."""
    return Response(ApiError.from_message(status_code, message, api).body, status_code=status_code,
                    media_type="application/json", headers=headers)


# The body was not read to its end: the connection cannot carry another request.
CLOSES_CONNECTION = frozenset({408, 413})


def api_error_response(err: ApiError) -> Response:
    """The response for a raised `ApiError`; a 408 or 413 also closes the connection."""
    headers = {"connection": "close"} if err.status_code in CLOSES_CONNECTION else None
    return Response(err.body, status_code=err.status_code, media_type="application/json", headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Answer Starlette's own HTTP errors (404 unknown path, 405 wrong method) in the API's shape."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        path = request.url.path
        if exc.status_code == 404:
            message = f"No route {request.method} {path}."
        elif exc.status_code == 405:
            message = f"{path} does not accept {request.method}."
        else:
            message = str(exc.detail) if exc.detail else HTTP_MESSAGES.get(exc.status_code, "HTTP error")
        return error_response(exc.status_code, message, api_of_path(path), headers=getattr(exc, "headers", None))


__all__ = ["add_error_handlers", "api_error_response", "api_of_path", "error_response"]
