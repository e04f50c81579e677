"""`deepinfer serve`: an HTTP server speaking OpenAI Chat Completions, OpenAI Responses, OpenAI
Completions and Anthropic Messages, streaming (server-sent events) and not.

The chat encoding of the checkpoint (the recipe plugin for DeepSeek-V4) converts each chat request into
prompt ids and sampling settings and turns generated ids back into that API's responses; the
`AsyncEngine` batches concurrent requests in the engine's steps. `generation.py` serves one chat
request, `completions.py` the raw-prompt API, `limits.py` and `auth.py` guard the door, `errors.py`
answers in each API's error shape, `serve_cli.py` is the command.

    deepinfer serve /path/to/checkpoint --port 8000
    deepinfer serve                       # the embedded tiny model, for trying the API
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from deepinfer_core.chat_contract import Api, ApiError, ChatEncoding
from deepinfer_core.engine.async_engine import AsyncEngine
from deepinfer_core.entrypoints.auth import ApiKeyMiddleware, instance_key_of
from deepinfer_core.entrypoints.chat import load_chat_encoding
from deepinfer_core.entrypoints.completions import handle_completions
from deepinfer_core.entrypoints.errors import add_error_handlers, api_error_response, error_response
from deepinfer_core.entrypoints.generation import CLIENT_CLOSED_REQUEST, handle_generation
from deepinfer_core.entrypoints.limits import (
    ClientGone,
    HttpLimits,
    TrimHeap,
    max_token_bytes_of,
    read_body,
)
from deepinfer_core.entrypoints.metrics import ServerMetrics
from deepinfer_core.entrypoints.pd import setup_pd

if TYPE_CHECKING:
    from deepinfer_core.engine.engine import Engine

ROUTES: dict[str, Api] = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}


@dataclass
class ServerState:
    """What every request handler shares."""

    engine: AsyncEngine
    encoding: ChatEncoding
    context_limit: int
    stop_token_ids: list[int]
    tokenizer: Any = None
    """The checkpoint's tokenizer (raw Completions prompts), or None."""
    bos_token_id: int | None = None
    vocab_size: int | None = None
    max_token_bytes: int | None = None
    """Bytes of the vocabulary's longest token: a longer prompt than context x this cannot fit."""
    limits: HttpLimits = field(default_factory=HttpLimits)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))


def context_limit_of(engine: Engine) -> int:
    """Longest prompt + output the engine accepts (its resolved `max_model_len`)."""
    return int(engine.config.max_model_len)


def build_app(
    engine: Engine,
    *,
    served_model_name: str | None = None,
    model_aliases: list[str] | tuple[str, ...] = (),
    limits: HttpLimits | None = None,
    api_key: str | None = None,
    public_url: str | None = None,
    pd_secret: str | None = None,
    prefill_urls: list[str] | tuple[str, ...] = (),
) -> FastAPI:
    """The FastAPI app serving `engine`; the engine loop thread starts now and stops with the app.

    :param engine: the synchronous engine (only the app's loop thread calls it from now on).
    :param served_model_name: the model name responses report and `/v1/models` lists; defaults to the
        chat encoding's first name. The official names of the model's family are always accepted too.
    :param model_aliases: more names requests may use.
    :param limits: body size and read-time limits (the connection limits are uvicorn's, see
        `running_server`); defaults to `HttpLimits()`.
    :param api_key: when set, every `/v1/...` request must present it (see `auth.py`).
    :param public_url: this server's base URL as other instances reach it; a prefill instance
        (`kv_transfer_role="prefill"`) serves its prefill routes under it (see `pd.py`).
    :param pd_secret: the secret the router and prefill/decode instances share (`DEEPINFER_PD_SECRET`);
        None: the API key is the instance key (`auth.instance_key_of`).
    :param prefill_urls: a decode instance's prefill instances, the only sources it reads KV from.
    """
    encoding = load_chat_encoding(engine.tokenizer, engine.model_config)
    names = [n for n in (served_model_name, *model_aliases) if n]
    if names and hasattr(encoding, "with_model_names"):
        encoding = encoding.with_model_names(names)
    state = ServerState(
        engine=AsyncEngine(engine), encoding=encoding, context_limit=context_limit_of(engine),
        stop_token_ids=_stop_token_ids(engine), tokenizer=engine.tokenizer,
        bos_token_id=getattr(engine.model_config, "bos_token_id", None),
        vocab_size=getattr(engine.model_config, "vocab_size", None),
        max_token_bytes=max_token_bytes_of(engine.tokenizer), limits=limits or HttpLimits(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.engine.shutdown()

    app = FastAPI(title="DeepInfer", lifespan=lifespan)
    app.state.server = state
    add_error_handlers(app)
    _add_routes(app, state)
    setup_pd(app, state, engine, instance_key_of(pd_secret, api_key), list(prefill_urls),
             public_url or "http://127.0.0.1:8000")
    app.add_middleware(TrimHeap)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


def _stop_token_ids(engine: Engine) -> list[int]:
    """Ids that end generation; the output parser never sees them."""
    eos_ids = list(getattr(engine, "eos_token_ids", None) or [])
    tokenizer_eos = getattr(engine.tokenizer, "eos_token_id", None)
    return eos_ids or ([tokenizer_eos] if tokenizer_eos is not None else [])


def _generation_endpoint(state: ServerState, api: Api) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handle_generation(state, api, request)

    return endpoint


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "deepinfer",
            "max_model_len": state.context_limit}


def _add_routes(app: FastAPI, state: ServerState) -> None:
    for path, api in ROUTES.items():
        app.add_api_route(path, _generation_endpoint(state, api), methods=["POST"], name=api)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_completions(state, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await count_message_tokens(state, request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(state, n) for n in state.encoding.model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id not in state.encoding.model_names:
            return error_response(404, f"The model `{model_id}` does not exist.", "chat")
        return JSONResponse(_model_card(state, model_id))

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(state.engine.last_stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


async def count_message_tokens(state: ServerState, request: Request) -> Response:
    """Anthropic's `POST /v1/messages/count_tokens`: `{"input_tokens": N}` for a Messages body (no `max_tokens`)."""
    try:
        raw = await read_body(request, state.limits, "messages")
        try:
            body = json.loads(raw)
        except ValueError as err:
            raise ApiError.from_message(400, f"The body is not valid JSON: {err}", "messages") from None
        if not isinstance(body, dict):
            raise ApiError.from_message(400, "The body must be a JSON object.", "messages")
        body = {**body, "max_tokens": 1, "stream": False}  # counted as if one token were asked for
        prepared = await run_in_threadpool(state.encoding.prepare, "messages", body, state.context_limit)
    except ApiError as err:
        return api_error_response(err)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse({"input_tokens": len(prepared.prompt_token_ids)})


__all__ = ["ROUTES", "ServerState", "build_app", "context_limit_of", "count_message_tokens", "handle_generation"]
