"""One chat-API request's life in the server: parse and encode, generate, answer (SSE or one body).

A client that disconnects ends its request: a streaming one when its send fails, a non-streaming one
as soon as the disconnect message arrives (answered 499, never a traceback). Both count as
`aborted` on `/metrics`, as does a client that leaves in the middle of its upload.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from deepinfer_core.chat_contract import Api, ApiError, OutputStream, PreparedRequest
from deepinfer_core.engine.async_engine import EngineDeadError
from deepinfer_core.entrypoints.errors import api_error_response, error_response
from deepinfer_core.entrypoints.limits import ClientGone, read_body
from deepinfer_core.entrypoints.pd import kv_transfer_of
from deepinfer_core.entrypoints.request_fields import (
    RequestFields,
    parse_body,
    read_request_fields,
    with_max_completion_tokens,
)

if TYPE_CHECKING:
    from deepinfer_core.entrypoints.serve import ServerState
    from deepinfer_core.sampling_params import SamplingParams

RESPONSE_ID_PREFIXES: dict[Api, str] = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}
TRAFFIC_CLASS_HEADER = "x-deepinfer-traffic-class"
"""Request header naming the prefix-store retention class ("agent", "chat", ...) of the request's blocks."""


class ModelOutputError(RuntimeError):
    """The engine ended the request with finish_reason "error" (the model's logits were not finite)."""

    MESSAGE = ("the model's output for this request is not finite (NaN or infinite logits); no further "
               "tokens were generated")

CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a client that left before the answer (nobody reads it)."""


async def handle_generation(state: ServerState, api: Api, request: Request) -> Response:
    """Serve one POST of `api`: parse and encode, generate, answer (SSE or one JSON body)."""

    arrival = time.monotonic()
    try:
        body = await read_body(request, state.limits, api)
        prepared, fields = await run_in_threadpool(prepare_request, state, api, body)
        prepared, images = await run_in_threadpool(lay_images_of, state, api, prepared)
        params = sampling_params_of(prepared, api, traffic_class_of(request), kv_transfer_of(request), fields)
        if params.structured_outputs is not None:
            await compile_grammar(state, params, api)
    except ApiError as err:
        state.metrics.count_request(api, "error")
        return api_error_response(err)
    except ClientGone:
        state.metrics.count_request(api, "aborted")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    response_id = RESPONSE_ID_PREFIXES[api] + uuid.uuid4().hex
    stream = state.encoding.open_stream(prepared, response_id, state.stop_token_ids)
    run = _Generation(state, api, prepared, params, stream, response_id, arrival, images)
    if not prepared.stream:
        return await run.whole(request)
    frames = run.frames()
    try:
        # Wait for the first frame before answering, so a request the engine rejects gets its status.
        first = await anext(frames, "")
    except (ValueError, EngineDeadError, ModelOutputError) as err:
        status = 400 if isinstance(err, ValueError) else 503 if isinstance(err, EngineDeadError) else 500
        return error_response(status, str(err), api)
    body = _prepend(first, frames, api)
    # On a disconnect Starlette cancels the send and drops the body unclosed; closing it aborts the request.
    return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(body.aclose))


async def _prepend(first: str, rest: AsyncGenerator[str, None], api: Api) -> AsyncIterator[str]:
    try:
        if first:
            yield first
        async for frame in rest:
            yield frame
    except (ModelOutputError, EngineDeadError) as err:  # the API's error event ends the stream, never a cut
        status = 503 if isinstance(err, EngineDeadError) else 500
        body = ApiError.from_message(status, str(err), api).body
        yield (f"event: error\ndata: {body}\n\n" if api == "messages" else f"data: {body}\n\n")
        if api == "chat":  # OpenAI's chat stream always ends with [DONE], as vLLM's does after an error
            yield "data: [DONE]\n\n"
    finally:
        await rest.aclose()


def traffic_class_of(request: Request) -> str | None:
    """The prefix-store traffic class the request's `TRAFFIC_CLASS_HEADER` names (None: the default)."""
    return request.headers.get(TRAFFIC_CLASS_HEADER) or None


def prepare_request(state: ServerState, api: Api, raw: bytes) -> tuple[PreparedRequest, RequestFields]:
    """Encode one body of `api` with the chat encoding, and read the fields the encoding does not read
    (`max_completion_tokens`, vLLM's sampling fields; see `request_fields.py`).

    :raises ApiError: 400 in `api`'s shape when the request is invalid or asks for what is not served.
    """
    body = parse_body(raw)
    if body is None:  # not a JSON object: the encoding answers with its own 400
        return state.encoding.prepare(api, raw, state.context_limit), RequestFields()
    fields = read_request_fields(body, api)
    encoded = raw if fields.max_completion_tokens is None else with_max_completion_tokens(body, fields)
    return state.encoding.prepare(api, encoded, state.context_limit), fields


def lay_images_of(state: ServerState, api: Api, prepared: PreparedRequest) -> tuple[PreparedRequest, tuple]:
    """The request with its images decoded, processed and laid into its ids (`Engine.prepare_images`),
    and the laid images; a text request as it is. Runs beside the engine loop (it reads only the config).

    :raises ApiError: 400 for an image the engine refuses (a limit, a bad file, a text-only model), 501
        for image input the engine's layout does not carry yet.
    """
    if not prepared.images:
        return prepared, ()
    try:
        ids, images = state.engine.engine.prepare_images(prepared.prompt_token_ids, list(prepared.images))
    except ValueError as err:
        raise ApiError.from_message(400, str(err), api) from err
    except NotImplementedError as err:
        raise ApiError.from_message(501, str(err), api) from err
    return replace(prepared, prompt_token_ids=ids), images


def sampling_params_of(prepared: PreparedRequest, api: Api, traffic_class: str | None = None,
                       kv_transfer_params: dict | None = None, fields: RequestFields | None = None) -> SamplingParams:
    """The engine's `SamplingParams` of a prepared API request and its extra fields.

    :raises ApiError: 400 when invalid (the message names the field).
    """
    from deepinfer_core.sampling_params import SamplingParams

    fields = fields or RequestFields()
    structured_outputs = prepared.structured_outputs
    if fields.structured_outputs is not None:
        if structured_outputs is not None:
            raise ApiError.from_message(400, "Give one structured-output constraint: 'response_format' (or "
                                        "'text.format') and 'structured_outputs'/'guided_*' were both set.", api)
        structured_outputs = fields.structured_outputs
    try:
        return SamplingParams(max_tokens=prepared.max_tokens, temperature=prepared.temperature,
                              top_p=prepared.top_p, seed=prepared.seed, logprobs=prepared.logprobs,
                              structured_outputs=structured_outputs, traffic_class=traffic_class,
                              kv_transfer_params=kv_transfer_params, **fields.sampling)
    except (ValueError, TypeError, NotImplementedError) as err:
        raise ApiError.from_message(400, str(err), api) from err


async def compile_grammar(state: ServerState, params: SamplingParams, api: Api) -> None:
    """Compile the request's grammar on the engine's grammar pool, off the event loop and the engine
    loop; an invalid grammar, or one that compiles too slowly, is a 400 with xgrammar's message."""
    try:
        await run_in_threadpool(state.engine.engine.structured_output.wait, params.structured_outputs)
    except ValueError as err:
        raise ApiError.from_message(400, str(err), api) from err


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has disconnected (call after the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_done_or_disconnect(work: asyncio.Future, request: Request) -> bool:
    """Wait for `work` or the client's disconnect; on a disconnect cancel `work` and wait until it has
    unwound (its cleanup ran). Returns whether the client is still there."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not work.done():
            work.cancel()
            # `cancelled()` only turns true once the task has run its cancellation.
            await asyncio.wait({work})
    return not work.cancelled()


class _Generation:
    """One request's run through the engine, as SSE frames or as one accumulated body."""

    def __init__(self, state: ServerState, api: Api, prepared: PreparedRequest, params: SamplingParams,
                 stream: OutputStream, request_id: str, arrival: float, images: tuple = ()) -> None:
        self.state, self.api, self.prepared, self.params, self.images = state, api, prepared, params, images
        self.stream, self.request_id, self.arrival = stream, request_id, arrival
        self.first_token_at: float | None = None
        self.last_output: Any = None

    async def frames(self) -> AsyncIterator[str]:
        """Engine outputs -> this API's SSE frames; stops (and aborts the engine) once the response ends."""
        outputs = self.state.engine.generate(self.prepared.prompt_token_ids, self.params, self.request_id,
                                             self.images)
        outcome = "aborted"
        try:
            async for output in outputs:
                self._observe(output)
                if output.finished and any(c.finish_reason == "error" for c in output.outputs):
                    outcome = "error"
                    raise ModelOutputError(ModelOutputError.MESSAGE)
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
        """The non-streaming body; a client that disconnects first aborts the request (499)."""
        collect = asyncio.ensure_future(self._drain())
        if not await until_done_or_disconnect(collect, request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        try:
            collect.result()
        except ValueError as err:
            return error_response(400, str(err), self.api)
        except EngineDeadError as err:
            return error_response(503, str(err), self.api)
        except ModelOutputError as err:
            return error_response(500, str(err), self.api)
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
        self.state.metrics.record_request(self.api, outcome, len(self.prepared.prompt_token_ids),
                                          self.last_output, self.arrival)


__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "RESPONSE_ID_PREFIXES",
    "TRAFFIC_CLASS_HEADER",
    "ModelOutputError",
    "compile_grammar",
    "handle_generation",
    "prepare_request",
    "sampling_params_of",
    "traffic_class_of",
    "until_done_or_disconnect",
    "wait_for_disconnect",
]
