"""Clients that leave: mid-generation (non-streaming) and mid-upload. 499, no traceback, counted."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
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


# -- fields the chat encoding does not read (issue 49 items 4, 8 and 9) ----------------------------

NO_THINKING = {"thinking": {"type": "disabled"}}
SEA = [{"role": "user", "content": "Say something about the sea."}]


def post(live_server: LiveServer, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(f"{live_server.base_url}{path}", json={"model": SERVED_NAME, **body}, timeout=300)


def test_max_completion_tokens_bounds_the_answer(live_server: LiveServer) -> None:
    """Issue 49 item 4: what current OpenAI SDKs send was ignored (4 asked, 8,182 generated)."""
    alone = post(live_server, {"messages": SEA, "max_completion_tokens": 3, **NO_THINKING}).json()
    assert alone["usage"]["completion_tokens"] <= 3
    both = post(live_server, {"messages": SEA, "max_tokens": 40, "max_completion_tokens": 2, **NO_THINKING}).json()
    assert both["usage"]["completion_tokens"] <= 2  # as vLLM: max_completion_tokens wins over max_tokens
    refused = post(live_server, {"messages": SEA, "max_completion_tokens": 0})
    assert refused.status_code == 400 and "'max_completion_tokens'" in refused.json()["error"]["message"]


def test_top_k_one_samples_the_greedy_answer(live_server: LiveServer) -> None:
    """vLLM's `top_k` reaches the engine on every chat API: top_k=1 at temperature 1 is greedy."""
    greedy = post(live_server, {"messages": SEA, "max_tokens": 8, "temperature": 0, **NO_THINKING}).json()
    top_one = post(live_server, {"messages": SEA, "max_tokens": 8, "top_k": 1, "seed": 3, **NO_THINKING}).json()
    assert top_one["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    messages = {"messages": SEA, "max_tokens": 8, **NO_THINKING}
    anthropic_greedy = post(live_server, {**messages, "temperature": 0}, "/v1/messages").json()
    anthropic_top_one = post(live_server, {**messages, "top_k": 1, "temperature": 1}, "/v1/messages").json()
    assert anthropic_top_one["content"] == anthropic_greedy["content"]  # Anthropic's own top_k


@pytest.mark.parametrize("constraint", [
    {"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}},
    {"guided_regex": "(yes|no)"}, {"guided_grammar": 'root ::= "yes" | "no"'},
    {"guided_json": {"enum": ["yes", "no"]}},
])
def test_vllm_structured_output_fields_constrain_the_answer(live_server: LiveServer, constraint: dict) -> None:
    body = post(live_server, {"messages": SEA, "max_tokens": 12, **NO_THINKING, **constraint}).json()
    content = body["choices"][0]["message"]["content"]
    assert (json.loads(content) if "guided_json" in constraint else content) in ("yes", "no")
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("field, value", [
    ("chat_template", "{{ messages }}"), ("use_beam_search", True), ("echo", True),
    ("continue_final_message", True), ("top_k", "x"), ("min_p", 2), ("repetition_penalty", 0),
    ("presence_penalty", 5), ("guided_json", "{not json"), ("structured_outputs", {"lark": "x"}),
])
def test_vllm_fields_not_served_are_400s_naming_them(live_server: LiveServer, field: str, value: object) -> None:
    """Never silently dropped: a field this server cannot honour, or a bad value, is a 400 naming it."""
    for path in ("/v1/chat/completions", "/v1/responses"):
        body = {"messages": SEA} if path.endswith("completions") else {"input": "hi"}
        response = post(live_server, {**body, "max_tokens": 2, field: value}, path)
        assert response.status_code == 400, (path, response.text)
        message = response.json()["error"]["message"]
        assert field.split("_")[0] in message or "structured outputs" in message, message


def test_two_structured_output_constraints_are_a_400(live_server: LiveServer) -> None:
    answer_in_json = [{"role": "user", "content": "Answer in json."}]
    both = post(live_server, {"messages": answer_in_json, "max_tokens": 2, "response_format": {"type": "json_object"},
                              "guided_regex": "a+"})
    assert both.status_code == 400 and "structured-output constraint" in both.json()["error"]["message"]


def test_logprobs_count_every_token_of_an_answer_ending_mid_character(live_server: LiveServer) -> None:
    """Issue 49 item 9: the last id ends mid-character; its logprob was missing (31 entries, 32 tokens)."""
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 32, "seed": 6,
            "logprobs": True, "top_logprobs": 1}
    whole = post(live_server, body).json()
    assert whole["choices"][0]["message"]["reasoning_content"].endswith("\ufffd")  # the case
    entries = [e for part in whole["choices"][0]["logprobs"].values() for e in part or []]
    assert len(entries) == whole["usage"]["completion_tokens"] == 32
    assert bytes(entries[-1]["bytes"]).decode("utf-8", "replace").endswith("\ufffd")  # the partial character
    streamed = post(live_server, {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")]
    streamed_entries = [e for part in logprobs for e in (part.get("content") or []) + (part.get("reasoning_content") or [])]
    assert len(streamed_entries) == chunks[-1]["usage"]["completion_tokens"] == 32
    assert streamed_entries == entries
