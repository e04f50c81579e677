"""A live server on 127.0.0.1 running the real engine on the embedded tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("deepinfer_recipe", reason="the HTTP server needs the recipe plugin (deepinfer[recipe])")

from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server
from tests.entrypoints.live import SERVED_NAME, LiveServer, tiny_engine


@pytest.fixture(scope="package")
def live_server() -> Iterator[LiveServer]:
    engine = tiny_engine(async_scheduling=True)  # as it serves on a GPU: decode steps overlapped
    app = build_app(engine, served_model_name=SERVED_NAME, model_aliases=["tiny"])
    with running_server(app) as base_url:
        yield LiveServer(base_url, app.state.server, engine)
