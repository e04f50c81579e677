"""`POST /v1/completions` through the `openai` SDK, on the real engine."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.live import SERVED_NAME, LiveServer


@pytest.fixture(scope="module")
def oai(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0)


def raw_prompt_ids(live_server: LiveServer, text: str) -> list[int]:
    return [live_server.engine.model_config.bos_token_id, *live_server.engine.tokenizer.encode(text)]


def test_text_prompt_streaming_and_not(oai: openai.OpenAI, live_server: LiveServer) -> None:
    kwargs = {"model": SERVED_NAME, "prompt": "The sea is", "max_tokens": 8, "temperature": 0}
    whole = oai.completions.create(**kwargs)
    chunks = list(oai.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop") and isinstance(choice.text, str)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert whole.usage.prompt_tokens == len(raw_prompt_ids(live_server, "The sea is"))
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens
    if choice.finish_reason == "length":
        assert whole.usage.completion_tokens == 8
    # The text is the engine's decode of the generated ids.
    engine_ids = live_server.engine.tokenizer.encode(choice.text)
    assert live_server.engine.tokenizer.decode(engine_ids) == choice.text


def test_token_id_prompt_matches_the_same_text(oai: openai.OpenAI, live_server: LiveServer) -> None:
    ids = raw_prompt_ids(live_server, "Once upon a time")
    by_ids = oai.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=6, temperature=0)
    by_text = oai.completions.create(model=SERVED_NAME, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_echo_stop_and_logprobs(oai: openai.OpenAI) -> None:
    full = oai.completions.create(model=SERVED_NAME, prompt="Count: one two", max_tokens=12, temperature=0).choices[0]
    echoed = oai.completions.create(model=SERVED_NAME, prompt="Count: one two", max_tokens=12, temperature=0,
                                    echo=True, logprobs=2).choices[0]
    assert echoed.text == "Count: one two" + full.text
    assert len(echoed.logprobs.token_logprobs) >= 1 and all(lp <= 0 for lp in echoed.logprobs.token_logprobs)
    if len(full.text.strip()) >= 4:
        stop = full.text.strip()[1:3]
        cut = oai.completions.create(model=SERVED_NAME, prompt="Count: one two", max_tokens=12, temperature=0,
                                     stop=[stop]).choices[0]
        assert cut.text == full.text[: full.text.index(stop)] and cut.finish_reason == "stop"
        streamed = oai.completions.create(model=SERVED_NAME, prompt="Count: one two", max_tokens=12, temperature=0,
                                          stop=[stop], stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text  # no part of the stop leaks


def test_invalid_requests_are_400s_in_openai_shape(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        oai.completions.create(model="gpt-3.5-turbo-instruct", prompt="x")
    with pytest.raises(openai.BadRequestError, match="Batched prompts"):
        oai.completions.create(model=SERVED_NAME, prompt=["a", "b"])
    with pytest.raises(openai.BadRequestError, match="'n' is not supported"):
        oai.completions.create(model=SERVED_NAME, prompt="a", n=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length") as err:
        oai.completions.create(model=SERVED_NAME, prompt="a", max_tokens=100_000)
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match=r"\[0, "):
        oai.completions.create(model=SERVED_NAME, prompt=[0, 10**9])
