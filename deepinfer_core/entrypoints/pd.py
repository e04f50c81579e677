"""The HTTP side of prefill/decode disaggregation on a `deepinfer serve --role prefill|decode` instance.

A prefill instance adds `POST /v1/pd/prefill/{api}` (api: chat, responses, messages, completions): the
router sends it the client's body; it encodes the prompt exactly as the API does, runs it (one token,
discarded), exports the prompt's blocks (`kv_transfer.export_prompt`) and answers
`{"kv_transfer_params": {"prefill": its URL, "id": ...}, "prompt_tokens": n}`. `GET /v1/pd/handles/{id}`
gives the full NIXL handle to the decode instance that reads the blocks.

A decode instance reads `KV_TRANSFER_HEADER` (the `kv_transfer_params` JSON) on the usual API routes
into `SamplingParams.kv_transfer_params`: its engine reads the blocks by NIXL before admitting the
request, then answers as a single instance would (`generation.py`).
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from deepinfer_core.chat_contract import ApiError
from deepinfer_core.entrypoints.errors import api_error_response, error_response
from deepinfer_core.entrypoints.limits import read_body

if TYPE_CHECKING:
    from deepinfer_core.entrypoints.serve import ServerState

KV_TRANSFER_HEADER = "x-deepinfer-kv-transfer"
"""Request header (JSON) a router sets on a decode instance's request: where the prompt's blocks are."""
PD_APIS = ("chat", "responses", "messages", "completions")


def kv_transfer_of(request: Request) -> dict | None:
    """The `kv_transfer_params` of a request to a decode instance (`KV_TRANSFER_HEADER`), or None.

    :raises ApiError: 400 when the header is not a JSON object.
    """
    raw = request.headers.get(KV_TRANSFER_HEADER)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not isinstance(value.get("prefill"), str) or not isinstance(value.get("id"), str):
        raise ApiError.from_message(400, f'{KV_TRANSFER_HEADER} must be a JSON object {{"prefill": url, "id": str}}',
                                    "chat")
    return value


def add_prefill_routes(app: FastAPI, state: ServerState, public_url: str) -> None:
    """The prefill instance's routes (see the module docstring); `public_url`: how decode instances reach it."""

    @app.post("/v1/pd/prefill/{api}")
    async def prefill(api: str, request: Request) -> Response:
        if api not in PD_APIS:
            return error_response(404, f"no prefill route for {api!r}; one of {PD_APIS}", "chat")
        try:
            prompt_ids, traffic_class = await _prompt_of(state, api, request)
        except ApiError as err:
            return api_error_response(err)
        handle = await _prefill(state, prompt_ids, traffic_class)
        return JSONResponse({"kv_transfer_params": {"prefill": public_url, "id": handle["id"]},
                             "prompt_tokens": len(prompt_ids), "num_blocks": len(handle["blocks"])})

    @app.get("/v1/pd/handles/{handle_id}")
    async def handle(handle_id: str) -> Response:
        found = state.engine.engine.prefix_tiers.exporter.handle(handle_id)
        if found is None:
            return JSONResponse({"error": f"no pending export {handle_id!r} (read already, or expired)"}, status_code=404)
        return JSONResponse(found)


async def _prompt_of(state: ServerState, api: str, request: Request) -> tuple[list[int], str | None]:
    from deepinfer_core.entrypoints.generation import traffic_class_of

    raw = await read_body(request, state.limits, "chat" if api == "completions" else api)
    if api == "completions":
        from deepinfer_core.entrypoints.completions import parse_request

        parsed = await run_in_threadpool(parse_request, state, raw)
        return parsed.prompt_token_ids, traffic_class_of(request)
    prepared = await run_in_threadpool(state.encoding.prepare, api, raw, state.context_limit)
    return list(prepared.prompt_token_ids), traffic_class_of(request)


async def _prefill(state: ServerState, prompt_ids: list[int], traffic_class: str | None) -> dict[str, Any]:
    from deepinfer_core.engine.kv_transfer import export_prompt
    from deepinfer_core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, traffic_class=traffic_class)
    async for _ in state.engine.generate(prompt_ids, params, "pd-" + uuid.uuid4().hex):
        pass
    return await state.engine.call(lambda engine: export_prompt(engine, prompt_ids))


__all__ = ["KV_TRANSFER_HEADER", "PD_APIS", "add_prefill_routes", "kv_transfer_of"]
