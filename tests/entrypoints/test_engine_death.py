"""A worker rank that dies mid-stream: the engine's death is logged with its cause, the open stream ends
with the API's error event (and chat's `[DONE]`) naming the rank, and later requests get a 503 naming it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal

import httpx

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.async_engine import EngineDeadError
from deepinfer_core.engine.engine import Engine
from deepinfer_core.entrypoints.generation import _prepend
from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server
from deepinfer_core.models.tiny import embedded_tiny_model_dir

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 400,
        "temperature": 0, "thinking": {"type": "disabled"}}


def test_a_rank_killed_mid_stream_ends_the_stream_with_the_error_event_naming_it(caplog):
    engine = Engine(EngineConfig(model=str(embedded_tiny_model_dir()), device="cpu", max_model_len=512,
                                 distributed_executor_backend="mp", world_size=2, worker_timeout_s=60))
    caplog.set_level(logging.ERROR, logger="deepinfer_core.engine.async_engine")
    with running_server(build_app(engine, served_model_name="tiny")) as base_url:
        lines = []
        with httpx.stream("POST", base_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and not lines:
                    os.kill(engine.executor._procs[1].pid, signal.SIGKILL)  # after the first frame
                lines.append(line)
        frames = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert frames[-1] == "[DONE]"
        error = json.loads(frames[-2])["error"]
        assert "worker rank 1" in error["message"] and "-9" in error["message"]
        later = httpx.post(base_url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert later.status_code == 503 and "worker rank 1" in later.json()["error"]["message"]
    deaths = [r for r in caplog.records if r.name == "deepinfer_core.engine.async_engine"]
    assert len(deaths) == 1 and "the engine stopped" in deaths[0].getMessage()
    assert "worker rank 1" in deaths[0].getMessage()


def test_messages_streams_end_with_the_error_event_shape():
    """The Anthropic shape: `event: error` then its data (no [DONE] in that API)."""

    async def frames():
        yield "event: message_start\ndata: {}\n\n"
        raise EngineDeadError("the engine loop failed: WorkerError('worker rank 1 exited during a step')")

    async def collect():
        rest = frames()
        first = await anext(rest)
        return [frame async for frame in _prepend(first, rest, "messages")]

    got = asyncio.run(collect())
    assert got[0].startswith("event: message_start") and got[-1].startswith("event: error\ndata: ")
    body = json.loads(got[-1].split("data: ", 1)[1])
    assert body["type"] == "error" and "worker rank 1" in body["error"]["message"]
    assert not any("[DONE]" in frame for frame in got)
