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
