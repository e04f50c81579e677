"""The HTTP side of prefill/decode disaggregation on a `deepinfer serve --role prefill|decode` instance.

A prefill instance adds `POST /v1/pd/prefill/{api}` (api: chat, responses, messages, completions): the
router sends it the client's body; it encodes the prompt and builds the sampling parameters exactly as
the API does, runs the prompt and samples the first token with them, exports the prompt's blocks and
the request's state (`kv_transfer.export_prompt`) and answers
`{"kv_transfer_params": {"prefill": its URL, "id": ..., "first_token": id}, "prompt_tokens": n}`; the
decode instance continues from that token with no prompt token to compute. (A request the decode
instance cannot continue that way, n > 1, logprobs or structured output, gets the blocks only and no
first token: the decode instance replays the windows and samples the first token itself.)
`GET /v1/pd/handles/{id}` gives the full NIXL handle to the decode instance that reads them.

A decode instance reads `KV_TRANSFER_HEADER` (the `kv_transfer_params` JSON) on the usual API routes
into `SamplingParams.kv_transfer_params`: its engine reads the blocks by NIXL before admitting the
request, then answers as a single instance would (`generation.py`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from deepinfer_core.chat_contract import ApiError
from deepinfer_core.entrypoints.errors import api_error_response, error_response
from deepinfer_core.entrypoints.limits import read_body
from deepinfer_core.sampling_params import KvTransferParams, SamplingParams

if TYPE_CHECKING:
    from deepinfer_core.entrypoints.serve import ServerState

KV_TRANSFER_HEADER = "x-deepinfer-kv-transfer"
"""Request header (JSON) a router sets on a decode instance's request: where the prompt's blocks are."""
PD_APIS = ("chat", "responses", "messages", "completions")


def kv_transfer_of(request: Request) -> KvTransferParams | None:
    """The `kv_transfer_params` of a request to a decode instance (`KV_TRANSFER_HEADER`), parsed once
    here, or None.

    :raises ApiError: 400 when the header is not a JSON object `{"prefill": url, "id": str, "first_token": int}`.
    """
    raw = request.headers.get(KV_TRANSFER_HEADER)
    if not raw:
        return None
    try:
        value = KvTransferParams.from_json(json.loads(raw))
    except ValueError as err:  # not JSON (json.JSONDecodeError is a ValueError), or a malformed handle
        why = str(err)
    else:
        if value.source:
            return value
        why = "it names no prefill instance"
    raise ApiError.from_message(400, f'{KV_TRANSFER_HEADER} must be a JSON object {{"prefill": url, "id": str}} '
                                     f"({why})", "chat")


def add_prefill_routes(app: FastAPI, state: ServerState, public_url: str) -> None:
    """The prefill instance's routes (see the module docstring); `public_url`: how decode instances reach it."""

    @app.post("/v1/pd/prefill/{api}")
    async def prefill(api: str, request: Request) -> Response:
        if api not in PD_APIS:
            return error_response(404, f"no prefill route for {api!r}; one of {PD_APIS}", "chat")
        try:
            prompt_ids, params = await _prompt_of(state, api, request)
        except ApiError as err:
            return api_error_response(err)
        try:
            handle = await _prefill(state, prompt_ids, params)
        except ValueError as err:  # the engine refused the request (an unknown traffic class, ...)
            return error_response(400, str(err), "chat" if api == "completions" else api)
        kv = KvTransferParams(prefill=public_url, id=handle["id"], first_token=handle["first_token"]).to_json()
        return JSONResponse({"kv_transfer_params": kv, "prompt_tokens": len(prompt_ids),
                             "num_blocks": len(handle["blocks"]), "has_state": handle.get("state_bytes") is not None})

    @app.get("/v1/pd/handles/{handle_id}")
    async def handle(handle_id: str) -> Response:
        found = state.engine.engine.prefix_tiers.exporter.handle(handle_id)
        if found is None:
            return JSONResponse({"error": f"no pending export {handle_id!r} (read already, or expired)"}, status_code=404)
        return JSONResponse(found)


async def _prompt_of(state: ServerState, api: str, request: Request) -> tuple[list[int], SamplingParams]:
    from deepinfer_core.entrypoints.generation import prepare_request, sampling_params_of, traffic_class_of

    raw = await read_body(request, state.limits, "chat" if api == "completions" else api)
    if api == "completions":
        from deepinfer_core.entrypoints.completions import parse_request

        parsed = await run_in_threadpool(parse_request, state, raw)
        parsed.params.traffic_class = traffic_class_of(request)
        return parsed.prompt_token_ids, parsed.params
    prepared, fields = await run_in_threadpool(prepare_request, state, api, raw)
    return list(prepared.prompt_token_ids), sampling_params_of(prepared, api, traffic_class_of(request), None, fields)


async def _prefill(state: ServerState, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """Run the prompt and sample its first token with the request's own parameters (so the decode
    instance's answer is the one a single instance gives), then export blocks, state and token."""
    from deepinfer_core.kv.nixl_transfer import continues_from_first_token, export_prompt

    if continues_from_first_token(params):
        run = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1),  # EOS banned as it would be
                      first_n_token_no_eos=min(params.first_n_token_no_eos, 1), kv_transfer_params=KvTransferParams(export=True))
    else:  # the decode instance samples the first token itself: only the blocks go
        run = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, traffic_class=params.traffic_class)
    request_id = "pd-" + uuid.uuid4().hex
    last = None
    async for output in state.engine.generate(prompt_ids, run, request_id):
        last = output
    tokens = last.outputs[0].token_ids if last is not None else []
    first = tokens[0] if tokens and run.kv_transfer_params else None
    return await state.engine.call(lambda engine: export_prompt(engine, prompt_ids, request_id, first))


__all__ = ["KV_TRANSFER_HEADER", "PD_APIS", "add_prefill_routes", "kv_transfer_of"]
