"""`deepinfer serve`: an HTTP server speaking OpenAI Chat Completions, OpenAI Responses and Anthropic
Messages, streaming (server-sent events) and not.

The chat encoding of the checkpoint (the recipe plugin for DeepSeek-V4) converts each request into
prompt ids and sampling settings and turns generated ids back into that API's responses; the
`AsyncEngine` batches concurrent requests in the engine's steps.

    deepinfer serve /path/to/checkpoint --port 8000
    deepinfer serve                       # the embedded tiny model, for trying the API
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from deepinfer_core.chat_contract import Api, ApiError, ChatEncoding, OutputStream, PreparedRequest
from deepinfer_core.engine.async_engine import AsyncEngine, EngineDeadError
from deepinfer_core.entrypoints.chat import load_chat_encoding
from deepinfer_core.entrypoints.metrics import ServerMetrics

if TYPE_CHECKING:
    from deepinfer_core.engine.engine import Engine
    from deepinfer_core.sampling_params import SamplingParams

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
RESPONSE_ID_PREFIXES: dict[Api, str] = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}
ROUTES: dict[str, Api] = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}


@dataclass
class ServerState:
    """What every request handler shares."""

    engine: AsyncEngine
    encoding: ChatEncoding
    context_limit: int
    stop_token_ids: list[int]
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
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
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app serving `engine`; the engine loop thread starts now and stops with the app.

    :param engine: the synchronous engine (only the app's loop thread calls it from now on).
    :param served_model_name: the model name responses report and `/v1/models` lists; defaults to the
        chat encoding's first name. The official names of the model's family are always accepted too.
    :param model_aliases: more names requests may use.
    :param max_body_bytes: larger request bodies are answered with 413.
    """
    encoding = load_chat_encoding(engine.tokenizer, engine.model_config)
    names = [n for n in (served_model_name, *model_aliases) if n]
    if names and hasattr(encoding, "with_model_names"):
        encoding = encoding.with_model_names(names)
    state = ServerState(
        engine=AsyncEngine(engine), encoding=encoding, context_limit=context_limit_of(engine),
        stop_token_ids=_stop_token_ids(engine), max_body_bytes=max_body_bytes,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.engine.shutdown()

    app = FastAPI(title="DeepInfer", lifespan=lifespan)
    app.state.server = state
    _add_routes(app, state)
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


def _add_routes(app: FastAPI, state: ServerState) -> None:
    for path, api in ROUTES.items():
        app.add_api_route(path, _generation_endpoint(state, api), methods=["POST"], name=api)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "deepinfer"}
                for name in state.encoding.model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(state.engine.last_stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


async def handle_generation(state: ServerState, api: Api, request: Request) -> Response:
    """Serve one POST of `api`: parse and encode, generate, answer (SSE or one JSON body)."""

    arrival = time.monotonic()
    try:
        body = await _read_body(request, state.max_body_bytes, api)
        prepared = await run_in_threadpool(state.encoding.prepare, api, body, state.context_limit)
        params = _sampling_params(prepared, api)
    except ApiError as err:
        state.metrics.count_request(api, "error")
        return Response(err.body, status_code=err.status_code, media_type="application/json")
    response_id = RESPONSE_ID_PREFIXES[api] + uuid.uuid4().hex
    stream = state.encoding.open_stream(prepared, response_id, state.stop_token_ids)
    run = _Generation(state, api, prepared, params, stream, response_id, arrival)
    if not prepared.stream:
        return await run.whole(request)
    frames = run.frames()
    try:
        # Wait for the first frame before answering, so a request the engine rejects gets its status.
        first = await anext(frames, "")
    except (ValueError, EngineDeadError) as err:
        return _error_response(400 if isinstance(err, ValueError) else 503, str(err), api)
    body = _prepend(first, frames)
    # On a disconnect Starlette cancels the send and drops the body unclosed; closing it aborts the request.
    return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(body.aclose))


async def _prepend(first: str, rest: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    try:
        if first:
            yield first
        async for frame in rest:
            yield frame
    finally:
        await rest.aclose()


async def _read_body(request: Request, limit: int, api: Api) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError.from_message(413, f"Request body is larger than {limit} bytes.", api)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError.from_message(413, f"Request body is larger than {limit} bytes.", api)
        chunks.append(chunk)
    return b"".join(chunks)


def _sampling_params(prepared: PreparedRequest, api: Api) -> SamplingParams:
    from deepinfer_core.sampling_params import SamplingParams

    try:
        return SamplingParams(max_tokens=prepared.max_tokens, temperature=prepared.temperature,
                              top_p=prepared.top_p, seed=prepared.seed, logprobs=prepared.logprobs)
    except (ValueError, NotImplementedError) as err:
        raise ApiError.from_message(400, str(err), api) from err


class _Generation:
    """One request's run through the engine, as SSE frames or as one accumulated body."""

    def __init__(self, state: ServerState, api: Api, prepared: PreparedRequest, params: SamplingParams,
                 stream: OutputStream, request_id: str, arrival: float) -> None:
        self.state, self.api, self.prepared, self.params = state, api, prepared, params
        self.stream, self.request_id, self.arrival = stream, request_id, arrival
        self.first_token_at: float | None = None
        self.last_output: Any = None

    async def frames(self) -> AsyncIterator[str]:
        """Engine outputs -> this API's SSE frames; stops (and aborts the engine) once the response ends."""
        outputs = self.state.engine.generate(self.prepared.prompt_token_ids, self.params, self.request_id)
        outcome = "aborted"
        try:
            async for output in outputs:
                self._observe(output)
                for frame in self.stream.push(output):
                    yield frame
                if self.stream.finished:
                    break
            for frame in self.stream.finish():
                yield frame
            outcome = "ok"
        finally:
            # A stop sequence, a disconnect or an error ends the request early: free its engine slot.
            self.state.engine.abort(self.request_id)
            await outputs.aclose()
            if outcome != "ok":
                self.stream.close()
            self._record(outcome)

    async def whole(self, request: Request) -> Response:
        """The non-streaming body; a client that disconnects first aborts the request."""

        collect = asyncio.ensure_future(self._drain())
        disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not collect.done():
                collect.cancel()
        if collect.cancelled():
            return Response(status_code=499)
        try:
            collect.result()
        except ValueError as err:
            return _error_response(400, str(err), self.api)
        except EngineDeadError as err:
            return _error_response(503, str(err), self.api)
        return Response(self.stream.response_json(), media_type="application/json")

    async def _drain(self) -> None:
        async for _ in self.frames():
            pass

    def _observe(self, output: Any) -> None:
        if self.first_token_at is None and output.outputs and output.outputs[0].token_ids:
            self.first_token_at = time.monotonic()
            self.state.metrics.time_to_first_token.observe(self.first_token_at - self.arrival)
        self.last_output = output

    def _record(self, outcome: str) -> None:
        metrics = self.state.metrics
        metrics.count_request(self.api, outcome)
        last = self.last_output
        metrics.prompt_tokens += len(self.prepared.prompt_token_ids)
        if last is not None:
            metrics.cached_prompt_tokens += int(last.num_cached_tokens or 0)
            metrics.generation_tokens += len(last.outputs[0].token_ids)
        if outcome == "ok":
            metrics.e2e_latency.observe(time.monotonic() - self.arrival)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _error_response(status_code: int, message: str, api: Api) -> Response:

    return Response(ApiError.from_message(status_code, message, api).body, status_code=status_code,
                    media_type="application/json")


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to `deepinfer`'s argument parser."""
    parser = subparsers.add_parser("serve", help="serve a checkpoint over HTTP (OpenAI and Anthropic APIs)",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", default=None,
                        help="checkpoint directory; omitted, the embedded tiny model is served")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name responses report (default: the family's official name)")
    parser.add_argument("--model-alias", action="append", default=[], help="another accepted model name")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    parser.add_argument("--enable-prefix-caching", action="store_true", help="reuse cached prompt prefixes")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted")
    parser.set_defaults(handler=run_serve)
    return parser


@contextmanager
def running_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` with uvicorn on a background thread (port 0 picks a free one); yields the base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="deepinfer-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.02)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(30)


def run_serve(args: argparse.Namespace) -> int:
    """Build the engine for `args.model_dir` and serve it until interrupted."""
    import uvicorn

    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.engine import Engine

    model_dir = args.model_dir
    if model_dir is None:
        from deepinfer_core.models.tiny import embedded_tiny_model_dir

        model_dir = str(embedded_tiny_model_dir())
    config = EngineConfig(model=model_dir, max_model_len=args.max_model_len,
                          enable_prefix_caching=args.enable_prefix_caching)
    app = build_app(Engine(config), served_model_name=args.served_model_name, model_aliases=args.model_alias,
                    max_body_bytes=args.max_body_bytes)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


__all__ = ["ServerState", "add_serve_parser", "build_app", "context_limit_of", "handle_generation", "run_serve", "running_server"]
