"""A decode instance under hostile KV transfer handles: a client's own `x-deepinfer-kv-transfer` header
(forged, or naming a host that is not a configured prefill instance) is never read, and a configured
"prefill instance" (a stub HTTP server here) answering garbage, a huge or deeply nested body, wrong
types, a pickle, or too slowly, costs a warning and a count: the engine stays healthy and every request
answers what it answers without a handle."""

from __future__ import annotations

import base64
import json
import os
import pickle
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from deepinfer_core.entrypoints.auth import INSTANCE_AUTH_HEADER, InstanceKey
from deepinfer_core.entrypoints.pd import sign_kv_transfer
from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server
from deepinfer_core.sampling_params import KvTransferParams
from tests.entrypoints.live import SERVED_NAME, tiny_engine
from tests.entrypoints.test_pd import LONG, NO_THINKING, metric_samples

pytest.importorskip("nixl_cu13._api", reason="prefill/decode disaggregation needs NIXL (the pd extra: nixl-cu13)")

API_KEY = "decode-test-key"
KEY = InstanceKey(API_KEY.encode())
SLOW_S = 3.0
HANDLE_TIMEOUT_S = 0.5
PROMPT = LONG[: len(LONG) // 4]  # two blocks or so: enough for a handle to be read


def handle_like(handle_id: str, **fields) -> bytes:
    """A handle with the right shape and `fields` changed."""
    base = {"id": handle_id, "blocks": [], "block_bytes": 0, "state_bytes": None, "num_prompt_tokens": 512,
            "first_token": None}
    return json.dumps({**base, **fields}).encode()


class _Pickled:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")  # what unpickling a handle's descriptors would run


def answers(state_bytes: int, marker: str) -> dict[str, bytes | None]:
    """Handle id -> the stub's body (None: special behaviour in the handler)."""
    payload = base64.b64encode(pickle.dumps(_Pickled(marker))).decode()
    return {
        "garbage": b"\x00\xff this is not JSON {",
        "nested": b"[" * 200_000 + b"]" * 200_000,
        "deep_object": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        "a_list": b"[1, 2, 3]",
        "other_id": handle_like("someone-else"),
        "blocks_not_a_list": handle_like("blocks_not_a_list", blocks="x"),
        "block_entry_wrong": handle_like("block_entry_wrong", blocks=[[1, 2, 3]]),
        "infinite_size": handle_like("infinite_size").replace(b'"block_bytes": 0', b'"block_bytes": 1e400'),
        "boolean_size": handle_like("boolean_size", block_bytes=True),
        "negative_size": handle_like("negative_size", state_bytes=-1),
        "state_of_another_model": handle_like("state_of_another_model", state_bytes=state_bytes + 1,
                                              agent="a", metadata="", region=[1, state_bytes + 1, 0, "DRAM"]),
        "region_mismatch": handle_like("region_mismatch", state_bytes=state_bytes, agent="a", metadata="",
                                       region=[1, 1 << 40, 0, "DRAM"]),
        "garbage_metadata": handle_like("garbage_metadata", state_bytes=state_bytes, agent="a",
                                        metadata=base64.b64encode(b"garbage").decode(),
                                        region=[4096, state_bytes, 0, "DRAM"]),
        "pickle": handle_like("pickle", state_bytes=state_bytes, agent="a", metadata="!", descs=payload,
                              region=[4096, state_bytes, 0, "DRAM"]),
        "huge": None, "slow": None, "server_error": None, "redirect": None,
    }


class Stub:
    """A "prefill instance" that answers `GET /pd/handles/{id}` with `answers[id]`, recording each call."""

    def __init__(self, bodies: dict[str, bytes | None]) -> None:
        self.bodies, self.calls = bodies, []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                handle_id = self.path.rsplit("/", 1)[-1]
                stub.calls.append((handle_id, self.headers.get(INSTANCE_AUTH_HEADER)))
                try:
                    stub.answer(self, handle_id)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the decode instance stopped reading, as it should

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, handler: BaseHTTPRequestHandler, handle_id: str) -> None:
        if handle_id == "slow":
            time.sleep(SLOW_S)
        if handle_id in ("server_error", "redirect"):
            handler.send_response(500 if handle_id == "server_error" else 302)
            handler.send_header("location", "http://127.0.0.1:1/pd/handles/x")
            handler.end_headers()
            return
        body = self.bodies.get(handle_id) or handle_like(handle_id)
        handler.send_response(200)
        handler.send_header("content-type", "application/json")
        if handle_id == "huge":  # no length announced: 256 MiB of a JSON string, streamed
            handler.end_headers()
            handler.wfile.write(b'{"id": "')
            for _ in range(256):
                handler.wfile.write(b"x" * (1 << 20))
            return
        handler.send_header("content-length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    engine = tiny_engine(kv_transfer_role="decode", max_num_seqs=4)
    state_bytes = engine.runner.block_io.io.slot_bytes  # a 512-token prompt: no partial block
    marker = str(tmp_path_factory.mktemp("pickle") / "unpickled")
    allowed, stranger = Stub(answers(state_bytes, marker)), Stub({})
    app = build_app(engine, served_model_name=SERVED_NAME, api_key=API_KEY, prefill_urls=[allowed.url])
    importer = engine.prefix_tiers.importer
    importer.client = replace(importer.client, timeout_s=HANDLE_TIMEOUT_S)
    with running_server(app) as base_url:
        yield {"url": base_url, "allowed": allowed, "stranger": stranger, "marker": marker}
    for stub in (allowed, stranger):
        stub.server.shutdown()


def ask(url: str, case: str, headers: dict[str, str] | None = None) -> str:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": f"Case {case}. {PROMPT}"}],
            "max_tokens": 3, "temperature": 0, **NO_THINKING}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                        headers={"authorization": f"Bearer {API_KEY}", **(headers or {})})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def check_answer_and_health(url: str, case: str, headers: dict[str, str]) -> float:
    """Send `case` with the hostile `headers`, then without: the same answer, the engine healthy.
    :returns: seconds the hostile request took."""
    started = time.monotonic()
    hostile = ask(url, case, headers)
    elapsed = time.monotonic() - started
    assert hostile == ask(url, case)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    return elapsed


def signed(prefill: str, handle_id: str) -> dict[str, str]:
    return sign_kv_transfer(KEY, KvTransferParams(prefill=prefill, id=handle_id))


def test_a_clients_own_handle_is_never_read(decode):
    before = metric_samples(decode["url"])
    forged = {"x-deepinfer-kv-transfer": json.dumps({"prefill": decode["allowed"].url, "id": "garbage"})}
    check_answer_and_health(decode["url"], "forged", forged)
    elsewhere = signed(decode["stranger"].url, "garbage")  # signed, but not a configured prefill instance
    check_answer_and_health(decode["url"], "elsewhere", elsewhere)
    assert decode["allowed"].calls == decode["stranger"].calls == []  # nobody was asked
    after = metric_samples(decode["url"])
    assert after['deepinfer_kv_transfer_refused_total{reason="signature"}'] == "1"
    assert after['deepinfer_kv_transfer_refused_total{reason="source"}'] == "1"
    assert after["deepinfer_kv_transfer_failures_total"] == before.get("deepinfer_kv_transfer_failures_total", "0")


@pytest.mark.parametrize("case", list(answers(0, "")))
def test_a_hostile_answer_from_a_prefill_instance_is_a_counted_failure_never_a_dead_engine(decode, case):
    failures = "deepinfer_kv_transfer_failures_total"
    before = int(metric_samples(decode["url"]).get(failures, 0))
    elapsed = check_answer_and_health(decode["url"], case, signed(decode["allowed"].url, case))
    assert int(metric_samples(decode["url"])[failures]) == before + 1
    # the decode instance read it with the instance key's signature for this handle
    assert decode["allowed"].calls[-1] == (case, KEY.sign("handle", case))
    if case == "slow":
        assert elapsed < SLOW_S  # given up after the handle timeout, not held for the stub's delay
    if case == "pickle":
        assert not os.path.exists(decode["marker"])  # its descriptors were never unpickled
