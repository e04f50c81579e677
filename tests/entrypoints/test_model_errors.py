"""A request whose logits are not finite is answered with an error in the API's shape, never a made-up
answer: a 500 before any byte was sent, else the stream's error event."""

from __future__ import annotations

import httpx
import pytest

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server
from deepinfer_core.models.tiny import embedded_tiny_config, embedded_tiny_model_dir, random_state_dict


@pytest.fixture(scope="module")
def overflowing_server():
    weights = random_state_dict(embedded_tiny_config(), seed=0)
    weights["lm_head.weight"] = weights["lm_head.weight"].clone()
    weights["lm_head.weight"][5] = 3e38  # finite, but every logit it makes overflows to +-inf
    engine = Engine(EngineConfig(model=str(embedded_tiny_model_dir()), device="cpu", max_model_len=512),
                    weights=weights)
    with running_server(build_app(engine, served_model_name="tiny")) as base_url:
        yield base_url


@pytest.mark.parametrize(("path", "body", "error_key"), [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}, "error"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}, "error"),
])
def test_nonfinite_logits_are_a_500_in_the_api_shape(overflowing_server, path, body, error_key):
    for stream in (False, True):
        response = httpx.post(overflowing_server + path, json={**body, "stream": stream, "max_tokens": 8},
                              timeout=60)
        assert response.status_code == 500, response.text  # the first token fails: nothing was sent yet
        error = response.json()[error_key]
        assert "not finite" in error["message"]
