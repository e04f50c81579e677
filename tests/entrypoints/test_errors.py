"""404 and 405 in each API's error shape, `GET /v1/models/{id}`, Anthropic's token counting."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.entrypoints.live import SERVED_NAME, LiveServer

USER = [{"role": "user", "content": "Say something about the sea."}]


def test_unknown_path_and_wrong_method_use_the_openai_shape(live_server: LiveServer) -> None:
    missing = httpx.post(f"{live_server.base_url}/v1/embeddings", json={})
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error" and "detail" not in missing.json()
    wrong = httpx.get(f"{live_server.base_url}/v1/chat/completions")
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
    assert "does not accept GET" in wrong.json()["error"]["message"]


def test_unknown_path_and_wrong_method_use_the_anthropic_shape(live_server: LiveServer) -> None:
    missing = httpx.post(f"{live_server.base_url}/v1/messages/batches", json={})
    assert missing.status_code == 404
    assert missing.json()["type"] == "error" and missing.json()["error"]["type"] == "not_found_error"
    wrong = httpx.get(f"{live_server.base_url}/v1/messages")
    assert wrong.status_code == 405 and wrong.json()["type"] == "error"


def test_one_model_by_id(live_server: LiveServer) -> None:
    oai = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0)
    model = oai.models.retrieve(SERVED_NAME)
    assert model.id == SERVED_NAME and model.object == "model"
    with pytest.raises(openai.NotFoundError, match="nope"):
        oai.models.retrieve("nope")


def test_count_tokens_equals_the_messages_prompt(live_server: LiveServer) -> None:
    claude = anthropic.Anthropic(base_url=live_server.base_url, api_key="unused", max_retries=0)
    counted = claude.messages.count_tokens(model=SERVED_NAME, messages=USER, thinking={"type": "disabled"})
    body = {"model": SERVED_NAME, "max_tokens": 10, "messages": USER, "thinking": {"type": "disabled"}}
    assert counted.input_tokens == len(live_server.state.encoding.prepare("messages", body, 2048).prompt_token_ids)
    with_system = claude.messages.count_tokens(model=SERVED_NAME, messages=USER, system="Be brief.",
                                               thinking={"type": "disabled"})
    assert with_system.input_tokens > counted.input_tokens
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.count_tokens(model="claude-x", messages=USER)
    assert err.value.body["type"] == "error"


def test_anthropic_messages_need_max_tokens(live_server: LiveServer) -> None:
    """Issue 43 item 7: without `max_tokens` a Messages request generated to the context limit."""
    response = httpx.post(f"{live_server.base_url}/v1/messages", json={"model": SERVED_NAME, "messages": USER})
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_every_openai_400_has_the_same_error_fields(live_server: LiveServer) -> None:
    """Issue 49 item 9: recipe's 400s set `code` to a string, the server's own to null."""
    chat = {"model": SERVED_NAME, "messages": USER, "max_tokens": 2}
    cases = [
        ("/v1/chat/completions", {**chat, "n": 2}),  # refused by recipe
        ("/v1/chat/completions", {**chat, "model": "gpt-4o"}),  # recipe: unknown model
        ("/v1/chat/completions", {**chat, "temperature": "hot"}),  # recipe: the body does not parse
        ("/v1/chat/completions", {**chat, "max_tokens": 4000}),  # recipe: beyond the context
        ("/v1/chat/completions", {**chat, "top_k": -5}),  # the engine's parameters
        ("/v1/chat/completions", {**chat, "use_beam_search": True}),  # a vLLM field not served
        ("/v1/responses", {"model": "gpt-4o", "input": "hi", "max_output_tokens": 2}),
        ("/v1/completions", {"model": SERVED_NAME, "prompt": "", "max_tokens": 2}),
        ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "suffix": "x"}),
    ]
    shapes = set()
    for path, body in cases:
        response = httpx.post(f"{live_server.base_url}{path}", json=body)
        assert response.status_code == 400, (path, body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
        shapes.add((tuple(sorted(error)), error["code"]))
    assert shapes == {(("code", "message", "param", "type"), None)}, shapes
