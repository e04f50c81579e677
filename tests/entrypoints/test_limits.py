"""What one client may cost: body read time, connections, and prompts too long for the context."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI, Request

from deepinfer_core.chat_contract import ApiError
from deepinfer_core.entrypoints.limits import HttpLimits, check_prompt_bytes, max_prompt_bytes
from deepinfer_core.entrypoints.serve_cli import running_server
from tests.entrypoints.live import SERVED_NAME, LiveServer


def connect(base_url: str) -> socket.socket:
    url = urlsplit(base_url)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def read_all(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


# -- item: bodies that never finish, connection caps -------------------------------------------------


def test_a_body_that_stops_arriving_is_a_408_and_the_connection_closes(live_server: LiveServer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live_server.state, "limits", HttpLimits(body_read_timeout_s=0.3))
    with connect(live_server.base_url) as conn:
        conn.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n{\"model\": ")
        reply = read_all(conn)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert b'"type": "error"' in body and b"did not arrive within 0.3 s" in body


def test_headers_that_stop_arriving_close_the_connection_and_others_are_served() -> None:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    with running_server(app, limits=HttpLimits(header_read_timeout_s=0.5)) as base_url:
        with connect(base_url) as slow, connect(base_url) as kept:
            slow.sendall(b"GET /ping HTTP/1.1\r\nhost: x\r\n")  # the headers never end
            kept.sendall(b"GET /ping HTTP/1.1\r\nhost: x\r\n\r\n")  # keep-alive: a second request follows
            first = b""
            while not first.endswith(b'{"ok":true}'):
                first += kept.recv(65536)
            assert first.startswith(b"HTTP/1.1 200")
            kept.sendall(b"GET /ping HTTP/1.1\r\nhost: x\r\n")  # ... but its headers stop too
            assert read_all(slow) == b"" and read_all(kept) == b""  # both closed, well before the 10 s socket timeout
        assert httpx.get(f"{base_url}/ping").json() == {"ok": True}


def test_connections_beyond_the_cap_are_refused() -> None:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    with running_server(app, limits=HttpLimits(limit_concurrency=3)) as base_url:
        idle = [connect(base_url), connect(base_url)]
        with connect(base_url) as third:
            third.sendall(b"GET /ping HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert read_all(third).startswith(b"HTTP/1.1 503")
        for conn in idle:
            conn.close()
        for _ in range(50):  # the server notices the closed connections on its loop
            if httpx.get(f"{base_url}/ping").status_code == 200:
                break
        assert httpx.get(f"{base_url}/ping").json() == {"ok": True}


def test_limits_reach_uvicorn() -> None:
    options = HttpLimits(limit_concurrency=7, timeout_keep_alive_s=3).uvicorn_options()
    assert options.pop("http").__name__ == "BoundedHeadersH11"
    assert options == {"limit_concurrency": 7, "timeout_keep_alive": 3}
    with pytest.raises(ValueError, match="positive"):
        HttpLimits(body_read_timeout_s=0)


# -- item: prompts too long for the context, refused before a full tokenization ----------------------


class Spy:
    """Counts the calls to one method and the characters they were given."""

    def __init__(self, fn) -> None:
        self.fn, self.calls, self.chars = fn, 0, 0

    def __call__(self, text, *args):
        self.calls += 1
        self.chars += len(text) if isinstance(text, str) else 0
        return self.fn(text, *args)


@pytest.fixture
def spies(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> tuple[Spy, Spy]:
    """(the plain tokenizer's encode, the chat encoding's exact encode)."""
    encoding = live_server.state.encoding
    plain, exact = Spy(encoding.tokenizer.encode), Spy(encoding.encode)
    monkeypatch.setattr(encoding.tokenizer, "encode", plain)
    monkeypatch.setattr(encoding, "encode", exact)
    return plain, exact


def chat_body(text: str) -> dict:
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def test_a_huge_body_is_refused_untokenized(live_server: LiveServer, spies: tuple[Spy, Spy]) -> None:
    text = "word " * (2 * 1024 * 1024)  # 10 MiB, under the 16 MiB body limit
    reply = httpx.post(f"{live_server.base_url}/v1/chat/completions", json=chat_body(text), timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "maximum context length is 2048" in error["message"]
    plain, exact = spies
    assert plain.calls == 0 and exact.calls == 0


def test_tokenization_stops_once_the_limit_is_passed(live_server: LiveServer, spies: tuple[Spy, Spy]) -> None:
    text = "\n".join(f"Line {i} says something about the sea" for i in range(5000))  # ~200K characters
    reply = httpx.post(f"{live_server.base_url}/v1/messages", json=chat_body(text), timeout=60)
    assert reply.status_code == 400 and reply.json()["type"] == "error"
    assert "maximum context length" in reply.json()["error"]["message"]
    plain, exact = spies
    assert exact.calls == 0  # the exact (whole-prompt) encoding never ran
    assert 0 < plain.chars < len(text) / 5  # a few pieces were enough to pass 2048 tokens


def test_a_raw_prompt_too_long_stops_early_too(live_server: LiveServer, spies: tuple[Spy, Spy]) -> None:
    text = "the sea is wide and blue " * 8000  # 200K characters
    reply = httpx.post(f"{live_server.base_url}/v1/completions",
                       json={"model": SERVED_NAME, "prompt": text, "max_tokens": 1}, timeout=60)
    assert reply.status_code == 400 and "maximum context length" in reply.json()["error"]["message"]
    plain, _ = spies
    assert 0 < plain.chars < len(text) / 5


def test_a_prompt_that_fits_is_served_as_before(live_server: LiveServer, spies: tuple[Spy, Spy]) -> None:
    # Over 8 characters a token of context, so counted first; ~1,500 tokens, so it fits.
    text = "\n".join(f"Line{i}" + " " * 60 + "x" for i in range(300))
    reply = httpx.post(f"{live_server.base_url}/v1/chat/completions",
                       json={**chat_body(text), "thinking": {"type": "disabled"}, "max_tokens": 1}, timeout=60)
    assert reply.status_code == 200
    plain, exact = spies
    assert plain.chars >= len(text) and exact.calls == 1  # counted whole, then encoded exactly once
    expected = live_server.state.encoding.prepare("chat", {**chat_body(text), "thinking": {"type": "disabled"}}, 2048)
    assert reply.json()["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)


def test_the_byte_bound() -> None:
    assert max_prompt_bytes(2048, 128) == 2048 * 128
    check_prompt_bytes("é" * 100, context_limit=100, max_token_bytes=2, api="chat")  # 200 bytes: may fit
    with pytest.raises(ApiError) as err:
        check_prompt_bytes("é" * 101, context_limit=100, max_token_bytes=2, api="messages")
    assert err.value.status_code == 400 and '"type": "error"' in err.value.body


def test_the_heap_is_trimmed_after_a_large_body_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_core.entrypoints import limits

    assert limits._malloc_trim() is not None  # glibc here: the real one is found
    trims = []
    monkeypatch.setattr(limits, "_malloc_trim", lambda: trims.append)
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    app.add_middleware(limits.TrimHeap)
    with running_server(app, limits=HttpLimits()) as base_url:
        assert httpx.post(f"{base_url}/echo", content=b"x" * 1000).json() == {"bytes": 1000}
        assert trims == []
        big = limits.TRIM_AFTER_BYTES + 1
        assert httpx.post(f"{base_url}/echo", content=b"x" * big).json() == {"bytes": big}
        for _ in range(100):  # the trim runs once the answer is sent
            if trims:
                break
            time.sleep(0.02)
        assert trims == [0]


def test_the_heap_is_trimmed_when_the_server_falls_idle_after_many_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43 item 7: after many streams the heap is trimmed once none is in flight, not only after a
    large body (RSS stayed +0.9 GiB after 200 streams until one came)."""
    from deepinfer_core.entrypoints import limits

    trims = []
    monkeypatch.setattr(limits, "_malloc_trim", lambda: trims.append)
    monkeypatch.setattr(limits, "TRIM_AFTER_REQUESTS", 5)
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    app.add_middleware(limits.TrimHeap)
    with running_server(app, limits=HttpLimits()) as base_url, httpx.Client() as client:
        for _ in range(4):
            assert client.post(f"{base_url}/echo", content=b"x").json() == {"bytes": 1}
        time.sleep(limits.TRIM_DELAY_S + 0.2)
        assert trims == []  # 4 requests: not yet
        client.post(f"{base_url}/echo", content=b"x")  # the fifth, then none in flight
        for _ in range(100):
            if trims:
                break
            time.sleep(0.02)
        assert trims == [0]
        for _ in range(4):  # counted again from the trim
            client.post(f"{base_url}/echo", content=b"x")
        time.sleep(limits.TRIM_DELAY_S + 0.2)
        assert trims == [0]
