"""The chat-encoding contract: what the HTTP server and `LLM.chat` need from a chat encoding.

Part of the plugin contract, beside `deepinfer_core.hookspecs`: a chat encoding (offered through the
`register_chat_encodings` hook) turns a request of one of the served APIs into prompt token ids and
sampling settings, and turns the engine's generated token ids back into that API's response events.
The recipe plugin (`deepinfer-recipe`) implements it with deepseek-recipe, so prompts, parsing and
response shapes match DeepSeek's own API. The core never imports that plugin; it talks to these Protocols.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Api = Literal["chat", "responses", "messages"]
"""The served HTTP APIs: OpenAI Chat Completions, OpenAI Responses, Anthropic Messages."""

APIS: tuple[Api, ...] = ("chat", "responses", "messages")


class ApiError(Exception):
    """A request that cannot be served, with the HTTP status and JSON body to answer with."""

    def __init__(self, status_code: int, body: str) -> None:
        super().__init__(body)
        self.status_code = status_code
        self.body = body

    @classmethod
    def from_message(cls, status_code: int, message: str, api: Api = "chat") -> ApiError:
        """Build an error whose body has the shape `api`'s clients expect.

        :param status_code: the HTTP status.
        :param message: a sentence the user can act on.
        :param api: which API's error envelope to use.
        """
        return cls(status_code, json.dumps(error_body(status_code, message, api)))


def error_type(status_code: int, api: Api) -> str:
    """The error `type` string each API uses for `status_code`."""
    if api == "messages":
        return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}.get(status_code, "api_error")
    return "invalid_request_error" if status_code < 500 else "internal_error"


def error_body(status_code: int, message: str, api: Api) -> dict[str, Any]:
    """An error body in `api`'s own shape (Anthropic wraps it in `{"type": "error", ...}`)."""
    if api == "messages":
        return {"type": "error", "error": {"type": error_type(status_code, api), "message": message}}
    return {"error": {"message": message, "type": error_type(status_code, api), "param": None, "code": None}}


@dataclass
class PreparedRequest:
    """A converted request: what the engine samples, and what the output parser needs (`state`)."""

    api: Api
    model: str
    """The model name to report in responses."""
    prompt_token_ids: list[int]
    max_tokens: int
    """Already resolved against the context length."""
    stream: bool
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    """Number of top alternatives to return per token, or `None` for no logprobs."""
    structured_outputs: Any = None
    """The `StructuredOutputsParams` the answer must follow (`response_format`), or `None`."""
    images: tuple[bytes, ...] = ()
    """The conversation's images, encoded (PNG, JPEG, ...), one per `image_token_id` in
    `prompt_token_ids`, in order; the engine decodes them and lays each into its span."""
    state: Any = field(default=None, repr=False)
    """The encoding's own conversion result; opaque to the core."""


@runtime_checkable
class OutputStream(Protocol):
    """Turns one request's engine outputs into response events of its API."""

    @property
    def finished(self) -> bool:
        """Whether the response is complete (a stop sequence may end it before the engine does)."""
        ...

    def push(self, output: Any) -> list[str]:
        """Feed one incremental `RequestOutput` (cumulative token ids); return new SSE frames.

        Stop-token ids are never shown to the parser; a finished output ends the response.
        """
        ...

    def finish(self) -> list[str]:
        """End the response (as a normal stop) if it has not ended; return the last SSE frames."""
        ...

    def response_json(self) -> str:
        """The whole response as one JSON body (non-streaming requests)."""
        ...

    def close(self) -> None:
        """Release the parser without producing a successful completion (errors, disconnects)."""
        ...


@runtime_checkable
class ChatEncoding(Protocol):
    """Conversation -> prompt ids, and generated ids -> API responses, for one checkpoint."""

    model_names: list[str]
    """Model names requests may use; the first is the one responses report."""

    def prepare(self, api: Api, body: bytes | dict[str, Any], context_limit: int) -> PreparedRequest:
        """Parse, validate and encode one request body.

        :raises ApiError: with the API's status and error body when the request is invalid.
        """
        ...

    def open_stream(self, prepared: PreparedRequest, response_id: str, stop_token_ids: list[int]) -> OutputStream:
        """Start the response for `prepared`, identified by `response_id`."""
        ...


__all__ = ["APIS", "Api", "ApiError", "ChatEncoding", "OutputStream", "PreparedRequest", "error_body", "error_type"]
