"""`--api-key`: the `openai` SDK's Bearer token, the `anthropic` SDK's x-api-key, 401s in each shape."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from deepinfer_core.entrypoints import auth
from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server
from tests.entrypoints.live import SERVED_NAME, tiny_engine

KEY = "sk-test-0123456789"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    app = build_app(tiny_engine(max_model_len=512), served_model_name=SERVED_NAME, api_key=KEY)
    with running_server(app) as base_url:
        yield base_url


def test_openai_clients_need_the_bearer_key(keyed_url: str) -> None:
    good = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=KEY, max_retries=0)
    reply = good.chat.completions.create(model=SERVED_NAME, messages=USER, max_tokens=1,
                                         extra_body={"thinking": {"type": "disabled"}})
    assert reply.usage.completion_tokens == 1
    assert good.models.list().data[0].id == SERVED_NAME
    bad = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.chat.completions.create(model=SERVED_NAME, messages=USER, max_tokens=1)
    assert err.value.status_code == 401 and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=SERVED_NAME, prompt="x", max_tokens=1)


def test_anthropic_clients_need_the_x_api_key(keyed_url: str) -> None:
    good = anthropic.Anthropic(base_url=keyed_url, api_key=KEY, max_retries=0)
    reply = good.messages.create(model=SERVED_NAME, max_tokens=1, messages=USER, thinking={"type": "disabled"})
    assert reply.usage.output_tokens == 1
    assert good.messages.count_tokens(model=SERVED_NAME, messages=USER).input_tokens > 0
    bad = anthropic.Anthropic(base_url=keyed_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model=SERVED_NAME, max_tokens=1, messages=USER)
    assert err.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": err.value.body["error"]["message"]}}


def test_missing_key_is_401_and_probes_stay_open(keyed_url: str) -> None:
    missing = httpx.post(f"{keyed_url}/v1/chat/completions", json={})
    assert missing.status_code == 401 and "Bearer" in missing.json()["error"]["message"]
    # Anthropic's key header is not accepted as a Bearer token on the OpenAI routes, nor the reverse.
    assert httpx.post(f"{keyed_url}/v1/chat/completions", json={}, headers={"x-api-key": KEY}).status_code == 401
    assert httpx.get(f"{keyed_url}/health").status_code == 200
    assert httpx.get(f"{keyed_url}/metrics").status_code == 200


def test_the_api_description_needs_the_key(keyed_url: str) -> None:
    """Issue 43 item 7: `/docs` and `/openapi.json` were open to anyone under `--api-key`."""
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        refused = httpx.get(f"{keyed_url}{path}")
        assert refused.status_code == 401, path
        assert "/v1/chat/completions" not in refused.text  # nothing of the API's description leaks
    described = httpx.get(f"{keyed_url}/openapi.json", headers={"authorization": f"Bearer {KEY}"})
    assert described.status_code == 200 and "/v1/chat/completions" in described.json()["paths"]


def test_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert auth.is_valid_key(KEY, KEY) and not auth.is_valid_key("sk-other", KEY)
    assert not auth.is_valid_key(None, KEY)
    assert calls == [(KEY.encode(), KEY.encode()), (b"sk-other", KEY.encode())]


def test_an_empty_key_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        auth.ApiKeyMiddleware(app=None, api_key="")
