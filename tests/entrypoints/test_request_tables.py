"""The server keeps nothing per request once a request is over (issue 43 item 7: RSS grew +0.9 GiB over
200 streams): every table reachable from the server and its engine (dicts, sets, lists, deques) is as
large after 200 more streamed requests, finished, aborted by a disconnect or refused, as after a warm-up,
but for caches bounded by construction (a `max_entries` attribute); and no more of our objects are alive
anywhere (closures and tasks included). Counted as objects, not as RSS.

Each count is taken after one lone request: a plan tells the runner which requests ended since the last
one, so the requests of the last batch are released with the next request's first step."""

from __future__ import annotations

import asyncio
import collections
import gc
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server
from tests.entrypoints.live import SERVED_NAME, tiny_engine
from tests.entrypoints.test_serve_concurrency import disconnect_midway

CONTAINERS = (dict, set, list, collections.deque, collections.OrderedDict)
SKIPPED = (torch.Tensor, torch.nn.Module, type, str, bytes, int, float)
MAX_DEPTH = 12
SLACK = 8
"""A table may differ by a few entries (a request of the warm-up still being dropped); one growing with
the requests grows by about 200."""


def bounded_tables(root: Any) -> dict[str, int]:
    """Path -> `max_entries` of the tables that declare a bound."""
    return {path: table.max_entries for path, table in _walk(root) if hasattr(table, "max_entries")}


def table_sizes(root: Any) -> dict[str, int]:
    """Path -> len() of every container reachable from `root` (see `_walk`)."""
    return {path: len(table) for path, table in _walk(root)}


def _walk(root: Any) -> Iterator[tuple[str, Any]]:
    """(path, container) for every container reachable from `root` through our objects' attributes and
    container items (each object once, by the first path that reaches it; tensors and modules are not
    entered)."""
    seen: set[int] = set()
    queue = collections.deque([("server", root, 0)])
    while queue:
        path, obj, depth = queue.popleft()
        if id(obj) in seen or depth > MAX_DEPTH or isinstance(obj, SKIPPED) or callable(obj) and not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        if isinstance(obj, CONTAINERS):
            yield path, obj
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            for index, (key, value) in enumerate(items):
                if index >= 64:  # a table's entries are alike: the first few stand for the rest
                    break
                queue.append((f"{path}[{key!r:.20}]" if isinstance(obj, dict) else f"{path}[{key}]", value, depth + 1))
            continue
        attributes = getattr(obj, "__dict__", None)
        if attributes is None and hasattr(obj, "__slots__"):
            attributes = {name: getattr(obj, name) for name in obj.__slots__ if hasattr(obj, name)}
        if _module_of(obj).split(".")[0] not in ("deepinfer_core", "deepinfer_recipe", "tests"):
            continue  # only our objects' tables (a library's internals are its own)
        for name, value in (attributes or {}).items():
            queue.append((f"{path}.{name}", value, depth + 1))


async def _stream(client: openai.AsyncOpenAI, index: int) -> None:
    kind = index % 4
    messages = [{"role": "user", "content": f"Request {index}: tell me a story."}]
    extra = {"thinking": {"type": "disabled"}}
    if kind == 3:  # a disconnect mid-stream: the engine aborts the request
        await disconnect_midway(client, index)
        return
    if kind == 2:  # the Responses API, with logprobs
        stream = await client.responses.create(model=SERVED_NAME, input=messages[0]["content"], max_output_tokens=6,
                                               stream=True, top_logprobs=2, include=["message.output_text.logprobs"],
                                               extra_body={"reasoning": {"effort": "none"}})
    else:  # Chat Completions, with logprobs every other time and a JSON schema the others
        options = ({"logprobs": True, "top_logprobs": 2} if kind == 0 else
                   {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                       "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}})
        stream = await client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=6,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body=extra, **options)
    async for _ in stream:
        pass


def live_objects() -> collections.Counter:
    """Our live objects (the core's, the recipe plugin's), by class, from the garbage collector's view."""
    gc.collect()
    return collections.Counter(f"{_module_of(obj)}.{type(obj).__qualname__}" for obj in gc.get_objects()
                               if _module_of(obj).startswith(("deepinfer_core.", "deepinfer_recipe.")))


def _module_of(obj: Any) -> str:
    module = getattr(type(obj), "__module__", None)
    return module if isinstance(module, str) else ""


async def _refused(base_url: str) -> None:
    async with httpx.AsyncClient() as client:  # a request refused before it reaches the engine
        answer = await client.post(f"{base_url}/v1/chat/completions", json={"model": SERVED_NAME, "messages": []})
        assert answer.status_code == 400


def _serve_requests(base_url: str, count: int, start: int) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        for first in range(start, start + count, 25):  # 25 at a time, concurrently
            await asyncio.gather(*(_stream(client, i) for i in range(first, min(first + 25, start + count))),
                                 _refused(base_url))
        await client.close()

    asyncio.run(run())


def _settled(base_url: str, server: Any, engine: Any, timeout_s: float = 60.0) -> None:
    """Wait until the engine has no request left (aborts of disconnected clients included), then serve
    one lone request (its plan releases the runner's state of the requests before it)."""
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() or server.engine._streams:
        assert time.monotonic() < deadline, "requests still in the engine long after every client left"
        time.sleep(0.05)
    _serve_requests(base_url, 1, 1)  # index 1: a plain chat request
    while engine.has_unfinished_requests() or server.engine._streams:
        assert time.monotonic() < deadline, "the lone request did not finish"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any, Any]]:
    engine = tiny_engine(async_scheduling=True)
    app = build_app(engine, served_model_name=SERVED_NAME)
    with running_server(app) as base_url:
        yield base_url, app.state.server, engine


def test_no_table_grows_with_the_requests_served(server) -> None:
    base_url, state, engine = server
    _serve_requests(base_url, 25, 0)  # warm-up: what is built once (grammar compilers, tasks) is built here
    _settled(base_url, state, engine)
    before, objects_before = table_sizes(state), live_objects()
    _serve_requests(base_url, 200, 25)
    _settled(base_url, state, engine)
    after, objects_after = table_sizes(state), live_objects()
    bounded = bounded_tables(state)
    grown = {path: (before.get(path, 0), size) for path, size in after.items()
             if size - before.get(path, 0) > SLACK and size > bounded.get(path, 0)}
    assert not grown, f"tables that grew with 200 requests (before, after): {grown}"
    assert len(after) > 50, "the walk found too few tables: it no longer reaches the engine"
    more = {name: (objects_before[name], count) for name, count in objects_after.items()
            if count - objects_before[name] > SLACK}
    assert not more, f"our objects that stayed alive after their requests (before, after): {more}"


def test_the_walk_finds_a_table_that_grows() -> None:
    class Leaky:
        __module__ = "tests.leak"

        def __init__(self) -> None:
            self.per_request: dict[str, int] = {}

    root = Leaky()
    root.per_request.update({f"r{i}": i for i in range(300)})
    assert table_sizes(root)["server.per_request"] == 300
