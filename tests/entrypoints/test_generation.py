"""Clients that leave: mid-generation (non-streaming) and mid-upload. 499, no traceback, counted."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
from starlette.requests import Request

from deepinfer_core.entrypoints.generation import CLIENT_CLOSED_REQUEST, handle_generation
from tests.entrypoints.live import SERVED_NAME, LiveServer

LONG = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1500,
        "thinking": {"type": "disabled"}}


def request_from(messages: list[dict]) -> Request:
    """A chat POST whose ASGI `receive` yields `messages`, then waits forever."""
    pending = list(messages)

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    return Request(scope, receive)


def aborted(live_server: LiveServer) -> int:
    return live_server.state.metrics.requests.get(("chat", "aborted"), 0)


def wait_idle(live_server: LiveServer) -> bool:
    for _ in range(200):
        if not asyncio.run(live_server.state.engine.call(lambda e: e.has_unfinished_requests())):
            return True
        time.sleep(0.05)
    return False


def test_non_streaming_disconnect_takes_the_499_path(live_server: LiveServer) -> None:
    before = aborted(live_server)
    request = request_from([{"type": "http.request", "body": json.dumps(LONG).encode(), "more_body": False},
                            {"type": "http.disconnect"}])
    response = asyncio.run(handle_generation(live_server.state, "chat", request))
    assert response.status_code == CLIENT_CLOSED_REQUEST
    assert aborted(live_server) == before + 1
    assert wait_idle(live_server)  # the engine request was aborted, not left running


def test_upload_disconnect_is_a_499_without_traceback(live_server: LiveServer) -> None:
    before = aborted(live_server)
    request = request_from([{"type": "http.request", "body": b'{"model": "dee', "more_body": True},
                            {"type": "http.disconnect"}])
    response = asyncio.run(handle_generation(live_server.state, "chat", request))
    assert response.status_code == CLIENT_CLOSED_REQUEST
    assert aborted(live_server) == before + 1


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_live_upload_disconnect_logs_nothing_and_is_counted(live_server: LiveServer) -> None:
    records = Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(records)
    before = aborted(live_server)
    try:
        url = urlsplit(live_server.base_url)
        with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 1000\r\n\r\n{\"model\": ")
            time.sleep(0.2)  # let the server start reading the body
        for _ in range(100):
            if aborted(live_server) > before:
                break
            time.sleep(0.05)
    finally:
        logger.removeHandler(records)
    assert aborted(live_server) == before + 1
    assert [r.getMessage() for r in records.records if r.levelno >= logging.ERROR] == []
    text = httpx.get(f"{live_server.base_url}/metrics").text
    assert f'deepinfer_requests_total{{api="chat",outcome="aborted"}} {before + 1}' in text


def test_live_non_streaming_disconnect_logs_nothing_and_is_counted(live_server: LiveServer) -> None:
    records = Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(records)
    before = aborted(live_server)
    try:
        try:
            httpx.post(f"{live_server.base_url}/v1/chat/completions", json=LONG, timeout=1.0)
        except httpx.ReadTimeout:
            pass  # the client gives up and closes its connection
        for _ in range(200):
            if aborted(live_server) > before:
                break
            time.sleep(0.05)
    finally:
        logger.removeHandler(records)
    assert aborted(live_server) == before + 1
    assert wait_idle(live_server)
    assert [r.getMessage() for r in records.records if r.levelno >= logging.ERROR] == []
