"""The HTTP side of prefill/decode disaggregation on a `deepinfer serve --role prefill|decode` instance.

A prefill instance adds `POST /v1/pd/prefill/{api}` (api: chat, responses, messages, completions): the
router sends it the client's body; it encodes the prompt and builds the sampling parameters exactly as
the API does, runs the prompt and samples the first token with them, exports the prompt's blocks and
the request's state (`kv_transfer.export_prompt`) and answers
`{"kv_transfer_params": {"prefill": its URL, "id": ..., "first_token": id}, "prompt_tokens": n}`; the
decode instance continues from that token with no prompt token to compute. (A request the decode
instance cannot continue that way, n > 1, logprobs or structured output, gets the blocks only and no
first token: the decode instance replays the windows and samples the first token itself.)
`GET /pd/handles/{id}` gives the full NIXL handle to the decode instance that reads them.

A decode instance reads `KV_TRANSFER_HEADER` (the `kv_transfer_params` JSON) on the usual API routes
into `SamplingParams.kv_transfer_params`: its engine reads the blocks by NIXL before admitting the
request, then answers as a single instance would (`generation.py`).

Trust: the router and the instances share an instance key (`auth.InstanceKey`: `DEEPINFER_PD_SECRET`,
else the API key; an instance with a role refuses to start without one). The router signs the handle
it passes on (`KV_TRANSFER_SIGNATURE_HEADER`) and its prefill calls (`auth.INSTANCE_AUTH_HEADER`); a
decode instance reads handles only from the prefill instances it was given (`--prefill-url`), signing
each read. A handle that is unsigned, wrongly signed or from another source is never read: the request
is computed here, with a warning and a count (`deepinfer_kv_transfer_refused_total`); one that fails
to read or parse is `deepinfer_kv_transfer_failures_total` (`kv.pd_handle`).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from deepinfer_core.chat_contract import ApiError
from deepinfer_core.entrypoints.auth import INSTANCE_AUTH_HEADER, PD_SECRET_ENV, InstanceKey
from deepinfer_core.entrypoints.errors import api_error_response, error_response
from deepinfer_core.entrypoints.limits import read_body
from deepinfer_core.kv.pd_handle import HandleClient, normalized_url
from deepinfer_core.sampling_params import KvTransferParams, SamplingParams

if TYPE_CHECKING:
    from deepinfer_core.entrypoints.metrics import ServerMetrics
    from deepinfer_core.entrypoints.serve import ServerState

logger = logging.getLogger(__name__)

KV_TRANSFER_HEADER = "x-deepinfer-kv-transfer"
"""Request header (JSON) a router sets on a decode instance's request: where the prompt's blocks are."""
KV_TRANSFER_SIGNATURE_HEADER = "x-deepinfer-kv-transfer-signature"
"""The router's signature of `KV_TRANSFER_HEADER`'s value (`InstanceKey.sign("kv-transfer", value)`)."""
PD_APIS = ("chat", "responses", "messages", "completions")
NO_KEY_HINT = (f"prefill/decode disaggregation needs a secret shared by the router and every instance: set "
               f"{PD_SECRET_ENV} (or give them all the same --api-key)")


@dataclass(frozen=True)
class KvTransferGate:
    """A decode instance's door for handles: only the router's (signed by the instance key), naming a
    configured prefill instance (`allowed`, normalized URLs)."""

    key: InstanceKey
    allowed: frozenset[str]
    metrics: ServerMetrics

    def admits(self, raw: str, signature: str | None, value: KvTransferParams) -> bool:
        """Whether the handle `value` (header text `raw`) may be read; else warn and count why."""
        if not self.key.verify("kv-transfer", raw, signature):
            return self._refuse("signature", "it is not signed by the router (missing or wrong signature)")
        try:
            is_allowed = normalized_url(value.prefill) in self.allowed
        except ValueError:
            is_allowed = False
        if not is_allowed:
            return self._refuse("source", f"{value.prefill!r} is not a configured prefill instance (--prefill-url)")
        return True

    def _refuse(self, reason: str, why: str) -> bool:
        self.metrics.count_kv_transfer_refused(reason)
        logger.warning("refused a KV transfer handle: %s; the prompt is computed here", why)
        return False


def sign_kv_transfer(key: InstanceKey, kv: KvTransferParams) -> dict[str, str]:
    """The headers handing `kv` to a decode instance (the router's): the handle and its signature."""
    raw = json.dumps(kv.to_json())
    return {KV_TRANSFER_HEADER: raw, KV_TRANSFER_SIGNATURE_HEADER: key.sign("kv-transfer", raw)}


def kv_transfer_of(request: Request) -> KvTransferParams | None:
    """The `kv_transfer_params` of a request to a decode instance (`KV_TRANSFER_HEADER`), parsed once
    here, or None: no header, or one the instance's `KvTransferGate` refuses (not a decode instance,
    not signed by the router, not from a configured prefill instance), which is computed here.

    :raises ApiError: 400 when the header is not a JSON object `{"prefill": url, "id": str, "first_token": int}`.
    """
    raw = request.headers.get(KV_TRANSFER_HEADER)
    if not raw:
        return None
    try:
        value = KvTransferParams.from_json(json.loads(raw))
    except (ValueError, RecursionError) as err:  # not JSON (a JSONDecodeError is a ValueError), or malformed
        why = str(err) or type(err).__name__
    else:
        if not value.source:
            why = "it names no prefill instance"
        else:
            app = request.scope.get("app")
            gate = getattr(app.state, "kv_transfer_gate", None) if app is not None else None
            if gate is None:
                logger.warning("a request to an instance that is not a decode instance carried %s; ignored",
                               KV_TRANSFER_HEADER)
                if app is not None and hasattr(app.state, "server"):
                    app.state.server.metrics.count_kv_transfer_refused("role")
                return None
            return value if gate.admits(raw, request.headers.get(KV_TRANSFER_SIGNATURE_HEADER), value) else None
    raise ApiError.from_message(400, f'{KV_TRANSFER_HEADER} must be a JSON object {{"prefill": url, "id": str}} '
                                     f"({why})", "chat")


def setup_pd(app: FastAPI, state: ServerState, engine, key: InstanceKey | None, prefill_urls: list[str],
             public_url: str) -> None:
    """Give a prefill or decode instance (`engine.config.kv_transfer_role`) its routes and its trust:
    the prefill routes, or the decode instance's `KvTransferGate` and its importer's `HandleClient`.

    :raises ValueError: a role without an instance key, a decode instance without `prefill_urls`, or
        `prefill_urls` on another instance.
    """
    role = engine.config.kv_transfer_role
    app.state.kv_transfer_gate = None
    if prefill_urls and role != "decode":
        raise ValueError("--prefill-url names the prefill instances a decode instance reads from: use it with "
                         "--role decode")
    if role is None:
        return
    if key is None:
        raise ValueError(NO_KEY_HINT)
    if role == "decode" and not prefill_urls:
        raise ValueError("a decode instance reads KV only from the prefill instances it is given: add "
                         "--prefill-url URL (repeatable)")
    tiers = getattr(engine, "prefix_tiers", None)
    if tiers is None:
        raise NotImplementedError("prefill/decode disaggregation with data_parallel_size > 1: give each DP rank "
                                  "its own instance")
    if role == "prefill":
        add_prefill_routes(app, state, public_url, key)
        return
    allowed = frozenset(normalized_url(url) for url in prefill_urls)
    app.state.kv_transfer_gate = KvTransferGate(key, allowed, state.metrics)
    tiers.importer.client = HandleClient(allowed, lambda handle_id: {INSTANCE_AUTH_HEADER: key.sign("handle", handle_id)},
                                         block_bytes=_block_bytes(engine), state_bytes=_state_bytes_of(engine))


def _block_bytes(engine) -> int:
    from deepinfer_core.kv.blocks import layout_bytes

    return layout_bytes(engine.executor.info.block_layout)


def _state_bytes_of(engine):
    """Bytes of a request's state for a prompt length (slot rings, then a partial block), where the
    runner is in this process; None (not checked) otherwise."""
    try:
        slot_bytes = engine.runner.block_io.io.slot_bytes
    except AttributeError:
        return None
    block_size, block_bytes = engine.executor.info.block_size, _block_bytes(engine)
    return lambda num_prompt: slot_bytes + (block_bytes if num_prompt % block_size else 0)


def add_prefill_routes(app: FastAPI, state: ServerState, public_url: str, key: InstanceKey) -> None:
    """The prefill instance's routes (see the module docstring); `public_url`: how decode instances reach
    it; `key`: the instance key the router and decode instances sign their calls with."""

    @app.post("/v1/pd/prefill/{api}")
    async def prefill(api: str, request: Request) -> Response:
        if api not in PD_APIS:
            return error_response(404, f"no prefill route for {api!r}; one of {PD_APIS}", "chat")
        if not key.verify("prefill", api, request.headers.get(INSTANCE_AUTH_HEADER)):
            return error_response(403, "only the router may call a prefill instance's prefill route", "chat")
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

    @app.get("/pd/handles/{handle_id}")
    async def handle(handle_id: str, request: Request) -> Response:
        if not key.verify("handle", handle_id, request.headers.get(INSTANCE_AUTH_HEADER)):
            return JSONResponse({"error": "only a decode instance holding the instance key may read a handle"},
                                status_code=403)
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


__all__ = ["KV_TRANSFER_HEADER", "KV_TRANSFER_SIGNATURE_HEADER", "PD_APIS", "KvTransferGate", "add_prefill_routes",
           "kv_transfer_of", "setup_pd", "sign_kv_transfer"]
