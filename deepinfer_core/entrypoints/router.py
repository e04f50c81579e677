"""`deepinfer router`: one endpoint in front of prefill and decode instances, speaking the same APIs.

    deepinfer serve CKPT --role prefill --port 8001
    deepinfer serve CKPT --role decode --port 8002
    deepinfer router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

For each request to `/v1/chat/completions`, `/v1/responses`, `/v1/messages` or `/v1/completions`, the
router picks the healthy prefill instance with the fewest requests in flight and sends it the body
(`/v1/pd/prefill/{api}`); the prefill instance computes the prompt's blocks, state and first token and
answers with their handle. The router then picks the least loaded healthy decode instance and forwards
the original request with the handle (`pd.KV_TRANSFER_HEADER`); the decode instance reads them by NIXL
and answers, and the router relays that answer (streamed or not) as it comes.

Health: every `--health-interval` seconds the router asks each instance's `/health`; one that does not
answer (or that refused a connection) is out of rotation until it answers again. A request is never
sent twice once an instance may have started it: an instance that refuses the connection is skipped
for the next one, but a prefill instance that fails or dies during the request ends it with a 503 in
the API's error shape naming the instance (the decode instances never see such a request), and with no
healthy instance of a role left the client gets a 503 saying so. Only a refused connection or a failed
health check takes an instance out of rotation: a failure during a request asks its `/health` at once,
and an instance's answer to a client's error (a 4xx) is relayed as it is. A client that leaves closes
the decode stream, which aborts the request there. `/health` of the router lists each instance's state
and answers 503 while a role has no healthy instance.

Its command (`router_cli.py`) parses without this module, so `deepinfer router --help` imports neither
FastAPI nor httpx. It is the cluster's front door, with the server's limits (`limits.HttpLimits`: body size and read time,
header read time, connection cap; a body over the limit is a 413 that reaches no instance) and its API
key (`--api-key`, checked here and passed on). It signs what it sends the instances with the instance
key (`auth.InstanceKey`: `DEEPINFER_PD_SECRET`, else the API key), so a decode instance takes a KV
transfer handle from the router only (`pd.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.responses import Response, StreamingResponse

from deepinfer_core.chat_contract import ApiError
from deepinfer_core.entrypoints.auth import (
    INSTANCE_AUTH_HEADER,
    ApiKeyMiddleware,
    InstanceKey,
    instance_key_of,
)
from deepinfer_core.entrypoints.errors import api_error_response, error_response
from deepinfer_core.entrypoints.http_options import HEALTH_INTERVAL_S
from deepinfer_core.entrypoints.limits import (
    ClientGone,
    HttpLimits,
    read_body,
)
from deepinfer_core.entrypoints.pd import NO_KEY_HINT, sign_kv_transfer
from deepinfer_core.sampling_params import KvTransferParams

ROUTED: dict[str, tuple[str, str]] = {
    "/v1/chat/completions": ("chat", "chat"), "/v1/responses": ("responses", "responses"),
    "/v1/messages": ("messages", "messages"), "/v1/completions": ("completions", "chat"),
}
"""Path -> (prefill route's api, error shape)."""
FORWARDED_HEADERS = ("authorization", "x-api-key", "anthropic-version", "content-type", "x-deepinfer-traffic-class")
PREFILL_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 2.0


class NoHealthyInstanceError(RuntimeError):
    """Every instance of a role is out of rotation (down, or refusing connections)."""


@dataclass
class Instance:
    """One prefill or decode instance and the router's view of its load and health."""

    url: str
    num_in_flight: int = 0
    num_requests: int = 0
    num_failures: int = 0
    is_healthy: bool = True
    """In rotation: its last health check (or connection) succeeded."""
    last_error: str = ""

    def mark_down(self, why: str) -> None:
        self.is_healthy, self.last_error = False, why


@dataclass
class Pool:
    """Instances of one role; `pick` takes the healthy one with the fewest requests in flight (round robin
    on ties), skipping `exclude`."""

    role: str
    instances: list[Instance]
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self, exclude: tuple[Instance, ...] = ()) -> Instance:
        """:raises NoHealthyInstanceError: when no instance is left."""
        turn = next(self._turn) % len(self.instances)
        order = [i for i in self.instances[turn:] + self.instances[:turn] if i.is_healthy and i not in exclude]
        if not order:
            down = "; ".join(f"{i.url}: {i.last_error or 'skipped'}" for i in self.instances)
            raise NoHealthyInstanceError(f"no healthy {self.role} instance is left ({down}); retry later")
        return min(order, key=lambda i: i.num_in_flight)

    @property
    def has_healthy(self) -> bool:
        return any(i.is_healthy for i in self.instances)


async def check_instance(client: httpx.AsyncClient, instance: Instance) -> None:
    """Ask `instance`'s `/health`: in rotation if it answers 200, out otherwise."""
    try:
        answer = await client.get(f"{instance.url}/health", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError as err:
        instance.mark_down(f"health check failed ({type(err).__name__})")
        return
    if answer.status_code == 200:
        instance.is_healthy, instance.last_error = True, ""
    else:
        instance.mark_down(f"health check answered {answer.status_code}")


async def check_health(client: httpx.AsyncClient, pools: dict[str, Pool]) -> None:
    """One round of health checks: each instance's `/health` sets whether it is in rotation."""
    await asyncio.gather(*(check_instance(client, i) for pool in pools.values() for i in pool.instances))


@dataclass
class _Upstream:
    """What every routed request shares: the HTTP client to the instances, the pools, the limits, the
    instance key, and the health probes started by failures (kept until done)."""

    client: httpx.AsyncClient
    pools: dict[str, Pool]
    limits: HttpLimits
    key: InstanceKey
    probes: set = field(default_factory=set)

    def failed(self, instance: Instance) -> None:
        """`instance` failed during a request: count it and ask its `/health` now (a failure may be the
        request's, never reason enough alone to take a healthy instance out of rotation)."""
        instance.num_failures += 1
        probe = asyncio.ensure_future(check_instance(self.client, instance))
        self.probes.add(probe)
        probe.add_done_callback(self.probes.discard)


def build_router_app(prefill_urls: list[str], decode_urls: list[str],
                     health_interval_s: float = HEALTH_INTERVAL_S, *, limits: HttpLimits | None = None,
                     api_key: str | None = None, pd_secret: str | None = None) -> FastAPI:
    """The router's app (see the module docstring); `health_interval_s` <= 0: no periodic checks.

    :param limits: the server's limits on what clients send (body size and read time); the connection
        limits are uvicorn's (`HttpLimits.uvicorn_options`, as `run_router` serves it).
    :param api_key: every `/v1/...` request must present it (`auth.ApiKeyMiddleware`); passed on.
    :param pd_secret: the instance key's secret (`DEEPINFER_PD_SECRET`); None: the API key.
    :raises ValueError: no instance of a role, or no instance key.
    """
    if not prefill_urls or not decode_urls:
        raise ValueError("a router needs at least one --prefill and one --decode instance")
    key = instance_key_of(pd_secret, api_key)
    if key is None:
        raise ValueError(NO_KEY_HINT)
    pools = {"prefill": Pool("prefill", [Instance(u.rstrip("/")) for u in prefill_urls]),
             "decode": Pool("decode", [Instance(u.rstrip("/")) for u in decode_urls])}
    client = httpx.AsyncClient(timeout=httpx.Timeout(PREFILL_TIMEOUT_S, connect=10.0))
    upstream = _Upstream(client, pools, limits or HttpLimits(), key)

    async def watch() -> None:
        while True:
            await check_health(client, pools)
            await asyncio.sleep(health_interval_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(watch()) if health_interval_s > 0 else None
        yield
        if watcher is not None:
            watcher.cancel()
        await client.aclose()

    app = FastAPI(title="DeepInfer router", lifespan=lifespan)
    app.state.pools, app.state.limits = pools, upstream.limits
    for path, (api, shape) in ROUTED.items():
        app.add_api_route(path, _endpoint(upstream, path, api, shape), methods=["POST"], name=api)

    _add_status_routes(app, upstream)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


def _add_status_routes(app: FastAPI, upstream: _Upstream) -> None:
    """`/v1/models` (a decode instance's, with the client's key), `/health` and `/metrics`."""
    client, pools = upstream.client, upstream.pools

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            answer = await client.get(f"{pools['decode'].pick().url}/v1/models", headers=_forwarded(request))
        except (NoHealthyInstanceError, httpx.HTTPError) as err:
            return error_response(503, str(err) or type(err).__name__, "chat")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        is_ok = all(pool.has_healthy for pool in pools.values())
        return JSONResponse({"status": "ok" if is_ok else "no healthy instance of some role",
                             **{role: [{"url": i.url, "healthy": i.is_healthy, "in_flight": i.num_in_flight,
                                        "error": i.last_error} for i in pool.instances]
                                for role, pool in pools.items()}}, status_code=200 if is_ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_render(pools), media_type="text/plain; version=0.0.4; charset=utf-8")


def _forwarded(request: Request) -> dict[str, str]:
    return {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}


async def _send(upstream: _Upstream, pool: Pool, request_of) -> tuple[Instance, httpx.Response]:
    """Send to the least loaded healthy instance, skipping (and taking out of rotation) those that refuse
    the connection: the request never reached them. Other failures propagate (it may have started) and
    ask the instance's health (`_Upstream.failed`). The chosen instance's `num_in_flight` is raised; the
    caller lowers it.
    :raises NoHealthyInstanceError: when every instance refused or is down."""
    client = upstream.client
    tried: tuple[Instance, ...] = ()
    while True:
        instance = pool.pick(exclude=tried)
        instance.num_in_flight += 1
        instance.num_requests += 1
        try:
            return instance, await client.send(request_of(instance), stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:
            instance.num_in_flight -= 1
            instance.num_failures += 1
            instance.mark_down(f"refused a connection ({type(err).__name__})")
            tried += (instance,)
        except httpx.HTTPError as err:
            instance.num_in_flight -= 1
            instance.last_error = f"failed during a request ({type(err).__name__})"
            upstream.failed(instance)
            raise _Failed(instance) from None


class _Failed(Exception):
    """An instance failed after the request may have reached it (not retried elsewhere)."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance


def _endpoint(upstream: _Upstream, path: str, api: str, shape: str):
    client, pools = upstream.client, upstream.pools

    async def endpoint(request: Request) -> Response:
        try:  # the server's limits: a body over the size is a 413 that reaches no instance
            body = await read_body(request, upstream.limits, shape)
        except ApiError as err:
            return api_error_response(err)
        except ClientGone:
            return Response(status_code=499)
        headers = _forwarded(request)
        prefill_headers = {**headers, INSTANCE_AUTH_HEADER: upstream.key.sign("prefill", api)}
        try:
            instance, answered = await _send(upstream, pools["prefill"], lambda i: client.build_request(
                "POST", f"{i.url}/v1/pd/prefill/{api}", content=body, headers=prefill_headers))
        except NoHealthyInstanceError as err:
            return error_response(503, str(err), shape)
        except _Failed as failed:
            return _prefill_failed(failed.instance, "connection lost", shape)
        try:
            answer = await answered.aread()
        except httpx.HTTPError as err:
            upstream.failed(instance)
            return _prefill_failed(instance, f"{type(err).__name__}: {err or 'connection lost'}", shape)
        finally:
            await answered.aclose()
            instance.num_in_flight -= 1
        if answered.status_code != 200:  # the API's own answer (a 400 for a bad body, a 401, ...)
            return Response(answer, status_code=answered.status_code, media_type="application/json")
        try:  # parsed once here; the decode instance gets the same JSON back
            kv = KvTransferParams.from_json(json.loads(answer)["kv_transfer_params"])
        except (ValueError, KeyError, TypeError) as err:
            instance.num_failures += 1
            return _prefill_failed(instance, f"malformed kv_transfer_params: {err}", shape)
        return await _relay(upstream, pools["decode"], path, body, {**headers, **sign_kv_transfer(upstream.key, kv)},
                            shape)

    return endpoint


def _prefill_failed(instance: Instance, why: str, shape: str) -> Response:
    return error_response(503, f"the prefill instance {instance.url} failed during this request ({why}); "
                               "retry the request", shape)


async def _relay(upstream: _Upstream, pool: Pool, path: str, body: bytes, headers: dict, shape: str):
    client = upstream.client
    try:
        instance, answered = await _send(upstream, pool, lambda i: client.build_request(
            "POST", f"{i.url}{path}", content=body, headers=headers))
    except NoHealthyInstanceError as err:
        return error_response(503, str(err), shape)
    except _Failed as failed:
        return error_response(503, f"the decode instance {failed.instance.url} failed; retry the request", shape)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in answered.aiter_raw():
                yield chunk
        finally:
            await answered.aclose()
            instance.num_in_flight -= 1

    media_type = answered.headers.get("content-type", "application/json")
    return StreamingResponse(chunks(), status_code=answered.status_code, media_type=media_type)


def _render(pools: dict[str, Pool]) -> str:
    lines = []
    for name, attr, kind in (("router_requests_in_flight", "num_in_flight", "gauge"),
                             ("router_requests_total", "num_requests", "counter"),
                             ("router_failures_total", "num_failures", "counter")):
        lines += [f"# TYPE deepinfer_{name} {kind}"]
        lines += [f'deepinfer_{name}{{role="{role}",instance="{i.url}"}} {getattr(i, attr)}'
                  for role, pool in pools.items() for i in pool.instances]
    lines += ["# TYPE deepinfer_router_instance_healthy gauge"]
    lines += [f'deepinfer_router_instance_healthy{{role="{role}",instance="{i.url}"}} {int(i.is_healthy)}'
              for role, pool in pools.items() for i in pool.instances]
    return "\n".join(lines) + "\n"


__all__ = ["Instance", "NoHealthyInstanceError", "Pool", "build_router_app", "check_health"]
