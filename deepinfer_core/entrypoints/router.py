"""`deepinfer router`: one endpoint in front of prefill and decode instances, speaking the same APIs.

    deepinfer serve CKPT --role prefill --port 8001
    deepinfer serve CKPT --role decode --port 8002
    deepinfer router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

For each request to `/v1/chat/completions`, `/v1/responses`, `/v1/messages` or `/v1/completions`, the
router picks the prefill instance with the fewest requests in flight and sends it the body
(`/v1/pd/prefill/{api}`); the prefill instance computes the prompt's blocks and answers with their
handle. The router then picks the least loaded decode instance and forwards the original request with
the handle (`pd.KV_TRANSFER_HEADER`); the decode instance reads the blocks by NIXL and answers, and
the router relays that answer (streamed or not) as it comes. A prefill instance that fails or dies
during the request ends it with a 503 in the API's error shape naming the instance; the decode
instances never see such a request. A client that leaves closes the decode stream, which aborts the
request there.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.responses import Response, StreamingResponse

from deepinfer_core.entrypoints.errors import error_response
from deepinfer_core.entrypoints.pd import KV_TRANSFER_HEADER

ROUTED: dict[str, tuple[str, str]] = {
    "/v1/chat/completions": ("chat", "chat"), "/v1/responses": ("responses", "responses"),
    "/v1/messages": ("messages", "messages"), "/v1/completions": ("completions", "chat"),
}
"""Path -> (prefill route's api, error shape)."""
FORWARDED_HEADERS = ("authorization", "x-api-key", "anthropic-version", "content-type", "x-deepinfer-traffic-class")
PREFILL_TIMEOUT_S = 600.0


@dataclass
class Instance:
    """One prefill or decode instance and the router's view of its load."""

    url: str
    num_in_flight: int = 0
    num_requests: int = 0
    num_failures: int = 0


@dataclass
class Pool:
    """Instances of one role; `pick` takes the one with the fewest requests in flight (round robin on ties)."""

    instances: list[Instance]
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> Instance:
        turn = next(self._turn)
        order = self.instances[turn % len(self.instances):] + self.instances[: turn % len(self.instances)]
        return min(order, key=lambda i: i.num_in_flight)


def build_router_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    """The router's app (see the module docstring)."""
    if not prefill_urls or not decode_urls:
        raise ValueError("a router needs at least one --prefill and one --decode instance")
    prefill = Pool([Instance(u.rstrip("/")) for u in prefill_urls])
    decode = Pool([Instance(u.rstrip("/")) for u in decode_urls])
    client = httpx.AsyncClient(timeout=httpx.Timeout(PREFILL_TIMEOUT_S, connect=10.0))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="DeepInfer router", lifespan=lifespan)
    app.state.pools = {"prefill": prefill, "decode": decode}
    for path, (api, shape) in ROUTED.items():
        app.add_api_route(path, _endpoint(client, prefill, decode, path, api, shape), methods=["POST"], name=api)

    @app.get("/v1/models")
    async def models() -> Response:
        upstream = await client.get(f"{decode.pick().url}/v1/models")
        return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", **{role: [i.url for i in pool.instances] for role, pool in
                                                 app.state.pools.items()}})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_render(app.state.pools), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _endpoint(client: httpx.AsyncClient, prefill: Pool, decode: Pool, path: str, api: str, shape: str):
    async def endpoint(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        instance = prefill.pick()
        instance.num_in_flight += 1
        instance.num_requests += 1
        try:
            answer = await client.post(f"{instance.url}/v1/pd/prefill/{api}", content=body, headers=headers)
        except httpx.HTTPError as err:
            instance.num_failures += 1
            return error_response(503, f"the prefill instance {instance.url} failed during this request "
                                       f"({type(err).__name__}: {err or 'connection lost'}); retry the request", shape)
        finally:
            instance.num_in_flight -= 1
        if answer.status_code != 200:  # the API's own answer (a 400 for a bad body, a 401, ...)
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        kv = answer.json()["kv_transfer_params"]
        return await _relay(client, decode.pick(), path, body, {**headers, KV_TRANSFER_HEADER: json.dumps(kv)}, shape)

    return endpoint


async def _relay(client: httpx.AsyncClient, instance: Instance, path: str, body: bytes, headers: dict, shape: str):
    instance.num_in_flight += 1
    instance.num_requests += 1
    try:
        upstream = await client.send(client.build_request("POST", f"{instance.url}{path}", content=body,
                                                          headers=headers), stream=True)
    except httpx.HTTPError as err:
        instance.num_in_flight -= 1
        instance.num_failures += 1
        return error_response(503, f"the decode instance {instance.url} failed ({type(err).__name__}: {err}); "
                                   "retry the request", shape)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            instance.num_in_flight -= 1

    media_type = upstream.headers.get("content-type", "application/json")
    return StreamingResponse(chunks(), status_code=upstream.status_code, media_type=media_type)


def _render(pools: dict[str, Pool]) -> str:
    lines = []
    for name, attr, kind in (("router_requests_in_flight", "num_in_flight", "gauge"),
                             ("router_requests_total", "num_requests", "counter"),
                             ("router_failures_total", "num_failures", "counter")):
        lines += [f"# TYPE deepinfer_{name} {kind}"]
        lines += [f'deepinfer_{name}{{role="{role}",instance="{i.url}"}} {getattr(i, attr)}'
                  for role, pool in pools.items() for i in pool.instances]
    return "\n".join(lines) + "\n"


def add_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `router` subcommand to `deepinfer`'s argument parser."""
    parser = subparsers.add_parser("router", help="route requests to prefill and decode instances",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", action="append", required=True, help="a prefill instance's base URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, help="a decode instance's base URL (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.set_defaults(handler=run_router)
    return parser


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(build_router_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="info")
    return 0


__all__ = ["Instance", "Pool", "add_router_parser", "build_router_app", "run_router"]
