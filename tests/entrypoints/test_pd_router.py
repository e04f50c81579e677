"""The router as the cluster's front door: the server's limits (body size and read time, header read
time, connection cap), a client's error never takes an instance out of rotation, its API key, and the
instance key it signs what it sends with. Stub instances (plain HTTP servers) stand in for prefill and
decode instances, so these need no engine and no NIXL."""

from __future__ import annotations

import argparse
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from deepinfer_core.entrypoints.auth import INSTANCE_AUTH_HEADER, InstanceKey
from deepinfer_core.entrypoints.limits import HttpLimits
from deepinfer_core.entrypoints.pd import KV_TRANSFER_HEADER, KV_TRANSFER_SIGNATURE_HEADER
from deepinfer_core.entrypoints.router import build_router_app
from deepinfer_core.entrypoints.router_cli import add_router_parser, run_router
from deepinfer_core.entrypoints.serve_cli import running_server
from tests.entrypoints.test_limits import connect, read_all

SECRET = "router-test-secret"
KEY = InstanceKey(SECRET.encode())
LIMITS = HttpLimits(max_body_bytes=1 << 20, body_read_timeout_s=0.5, limit_concurrency=3, header_read_timeout_s=0.5)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class StubInstance:
    """A prefill or decode instance that records each request; `/health` answers 200. A prefill body
    containing "bad" is a 400 (a client's error); containing "drop", the connection is dropped."""

    def __init__(self, role: str) -> None:
        self.role, self.requests = role, []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/health":
                    return self.reply(200, {"status": "ok"})
                stub.requests.append((self.path, dict(self.headers), b""))
                is_authorized = self.headers.get("authorization") == "Bearer good-key"
                return self.reply(200 if is_authorized else 401, {"data": []})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                stub.requests.append((self.path, dict(self.headers), body))
                if stub.role == "decode":
                    return self.reply(200, {"answered": True})
                if b"drop" in body:  # dies mid-request: the connection ends with no answer
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return None
                if b"bad" in body:
                    return self.reply(400, {"error": {"message": "bad request"}})
                return self.reply(200, {"kv_transfer_params": {"prefill": stub.url, "id": "h1", "first_token": 3}})

            def reply(self, status: int, value: dict) -> None:
                data = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def cluster():
    prefill, decode = StubInstance("prefill"), StubInstance("decode")
    app = build_router_app([prefill.url], [decode.url], health_interval_s=0, limits=LIMITS, pd_secret=SECRET)
    with running_server(app, limits=LIMITS) as base_url:
        yield {"router": base_url, "prefill": prefill, "decode": decode, "app": app}
    for stub in (prefill, decode):
        stub.server.shutdown()


def is_healthy(cluster) -> bool:
    return all(i.is_healthy for pool in cluster["app"].state.pools.values() for i in pool.instances)


def test_a_request_is_signed_for_the_instances(cluster):
    answer = httpx.post(f"{cluster['router']}/v1/chat/completions", json=CHAT, timeout=10)
    assert answer.status_code == 200 and answer.json() == {"answered": True}
    (path, headers, _), = cluster["prefill"].requests
    assert path == "/v1/pd/prefill/chat" and headers[INSTANCE_AUTH_HEADER] == KEY.sign("prefill", "chat")
    (path, headers, _), = cluster["decode"].requests
    handle = headers[KV_TRANSFER_HEADER]
    assert json.loads(handle) == {"prefill": cluster["prefill"].url, "id": "h1", "first_token": 3}
    assert headers[KV_TRANSFER_SIGNATURE_HEADER] == KEY.sign("kv-transfer", handle)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_a_413_that_reaches_no_instance_and_takes_none_down(cluster, chunked):
    big = b'{"messages": "' + b"x" * (LIMITS.max_body_bytes + 1) + b'"}'
    content = iter([big[i : i + 65536] for i in range(0, len(big), 65536)]) if chunked else big
    answer = httpx.post(f"{cluster['router']}/v1/chat/completions", content=content, timeout=10)
    assert answer.status_code == 413 and "larger than" in answer.json()["error"]["message"]
    assert cluster["prefill"].requests == [] and is_healthy(cluster)
    assert httpx.post(f"{cluster['router']}/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_a_body_that_stops_arriving_is_a_408(cluster):
    with connect(cluster["router"]) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n{\"model\": ")
        assert read_all(conn).startswith(b"HTTP/1.1 408")
    assert cluster["prefill"].requests == []


def test_a_clients_error_is_relayed_and_takes_no_instance_down(cluster):
    answer = httpx.post(f"{cluster['router']}/v1/chat/completions", json={**CHAT, "bad": 1}, timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "bad request"
    assert is_healthy(cluster) and cluster["decode"].requests == []
    assert httpx.post(f"{cluster['router']}/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_a_failure_during_a_request_asks_the_instances_health_before_taking_it_down(cluster):
    answer = httpx.post(f"{cluster['router']}/v1/chat/completions", json={**CHAT, "drop": 1}, timeout=10)
    assert answer.status_code == 503 and cluster["prefill"].url in answer.json()["error"]["message"]
    pool = cluster["app"].state.pools["prefill"]
    assert pool.instances[0].num_failures == 1
    assert httpx.post(f"{cluster['router']}/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
    assert is_healthy(cluster)  # its /health answered: still in rotation


def test_headers_that_stop_arriving_close_the_connection(cluster):
    with connect(cluster["router"]) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # the headers never end
        assert read_all(slow) == b""  # closed after the header timeout, well before the socket's 10 s


def test_connections_beyond_the_cap_are_refused(cluster):
    idle = [connect(cluster["router"]), connect(cluster["router"])]
    with connect(cluster["router"]) as third:
        third.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert read_all(third).startswith(b"HTTP/1.1 503")
    for conn in idle:
        conn.close()


def test_the_router_command_serves_with_the_limits_and_keys_it_is_given(monkeypatch):
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    args = parser.parse_args(["router", "--prefill", "http://p:1", "--decode", "http://d:2", "--api-key", "k",
                              "--max-body-bytes", "1000", "--limit-concurrency", "9", "--header-read-timeout", "2"])
    served = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **options: served.update(app=app, **options))
    monkeypatch.delenv("DEEPINFER_PD_SECRET", raising=False)
    assert run_router(args) == 0
    assert served["limit_concurrency"] == 9 and served["http"].__name__ == "BoundedHeadersH11"
    assert served["app"].state.limits.max_body_bytes == 1000


def test_under_an_api_key_the_router_checks_it_and_passes_it_on():
    prefill, decode = StubInstance("prefill"), StubInstance("decode")
    app = build_router_app([prefill.url], [decode.url], health_interval_s=0, api_key="good-key")
    with running_server(app, limits=LIMITS) as base_url:
        good = httpx.get(f"{base_url}/v1/models", headers={"authorization": "Bearer good-key"}, timeout=10)
        assert good.status_code == 200
        wrong = httpx.post(f"{base_url}/v1/chat/completions", json=CHAT, timeout=10,
                           headers={"authorization": "Bearer wrong"})
        assert wrong.status_code == 401 and prefill.requests == []
        assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200  # probes stay open
    for stub in (prefill, decode):
        stub.server.shutdown()


def test_a_router_without_an_instance_key_refuses_to_start(monkeypatch):
    with pytest.raises(ValueError, match="DEEPINFER_PD_SECRET"):
        build_router_app(["http://p:1"], ["http://d:2"])
