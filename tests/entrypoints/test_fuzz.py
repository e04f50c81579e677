"""Fuzzed request bodies on every generation API: never a 5xx, every error in the API's own shape.

Bounded: a fixed number of derandomized examples an API, each asking for at most a few tokens
(or for an invalid amount, answered before any generation).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.entrypoints.live import SERVED_NAME, LiveServer

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=3), max_leaves=6)
def mostly(valid: st.SearchStrategy, anything: st.SearchStrategy = VALUES) -> st.SearchStrategy:
    """Valid values three times in four, anything else otherwise."""
    return st.integers(0, 3).flatmap(lambda i: anything if i == 0 else valid)


MODELS = mostly(st.sampled_from([SERVED_NAME, "tiny"]), st.sampled_from(["gpt-4o", ""]) | VALUES)
AMOUNTS = mostly(st.integers(1, 2))  # a few tokens; anything else must be refused, not run
CONTENT = mostly(st.text(max_size=40))
MESSAGES = mostly(st.lists(st.fixed_dictionaries({"role": mostly(st.just("user")), "content": CONTENT}),
                           min_size=1, max_size=3))
EXTRA = mostly(st.just({}), st.dictionaries(
    st.sampled_from(["temperature", "top_p", "seed", "stop", "stream", "tools", "tool_choice", "logprobs",
                     "top_logprobs", "thinking", "reasoning", "n", "echo", "response_format", "stream_options",
                     "metadata"]), VALUES, max_size=3))

BODIES = {
    "/v1/chat/completions": st.fixed_dictionaries({"model": MODELS, "messages": MESSAGES, "max_tokens": AMOUNTS}),
    "/v1/responses": st.fixed_dictionaries({"model": MODELS, "input": CONTENT | MESSAGES,
                                            "max_output_tokens": AMOUNTS}),
    "/v1/messages": st.fixed_dictionaries({"model": MODELS, "messages": MESSAGES, "max_tokens": AMOUNTS}),
    "/v1/completions": st.fixed_dictionaries({"model": MODELS, "prompt": CONTENT, "max_tokens": AMOUNTS}),
}


def is_api_error(path: str, body: object) -> bool:
    if path == "/v1/messages":
        return isinstance(body, dict) and body.get("type") == "error" and isinstance(body["error"]["message"], str)
    return isinstance(body, dict) and isinstance(body.get("error", {}).get("message"), str)


@pytest.mark.parametrize("path", list(BODIES))
def test_fuzzed_bodies_never_fail_the_server(live_server: LiveServer, path: str) -> None:
    client = httpx.Client(base_url=live_server.base_url, timeout=60)
    statuses: set[int] = set()

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(fields=BODIES[path], extra=EXTRA)
    def check(fields: dict, extra: dict) -> None:
        body = {**extra, **fields}
        if body.get("stream") is True:
            body["stream"] = False  # streamed answers are covered elsewhere; here each reply is one body
        try:
            payload = json.dumps(body, allow_nan=True)
        except (ValueError, OverflowError):
            return
        reply = client.post(path, content=payload, headers={"content-type": "application/json"})
        statuses.add(reply.status_code)
        assert reply.status_code < 500, (body, reply.text)
        if reply.status_code >= 400:
            assert is_api_error(path, reply.json()), (body, reply.text)
        else:
            assert isinstance(reply.json(), dict), (body, reply.text)

    try:
        check()
    finally:
        client.close()
    assert 200 in statuses and 400 in statuses  # both served and refused bodies were tried
