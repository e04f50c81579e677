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
    echoed_logprobs = echoed.logprobs.token_logprobs  # the prompt's first (vLLM's echo), which has none
    assert len(echoed_logprobs) >= 2 and echoed_logprobs[0] is None and all(lp <= 0 for lp in echoed_logprobs[1:])
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


def test_echo_with_logprobs_gives_the_prompts_logprobs_first(oai: openai.OpenAI, live_server: LiveServer) -> None:
    """Issue 49 item 8: as vLLM, `echo` with `logprobs` lists the prompt's tokens (the first without a
    logprob: it has no context), then the completion's; the tokens line up with the text."""
    echoed = oai.completions.create(model=SERVED_NAME, prompt="Count: one two", max_tokens=4, temperature=0,
                                    echo=True, logprobs=2)
    choice, num_prompt = echoed.choices[0], echoed.usage.prompt_tokens
    tokens, token_logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
    assert len(tokens) == len(token_logprobs) == num_prompt + echoed.usage.completion_tokens
    assert token_logprobs[0] is None and all(lp <= 0 for lp in token_logprobs[1:])
    assert "".join(tokens[1:num_prompt]) == "Count: one two"  # after the BOS, the echoed prompt's tokens
    assert choice.logprobs.top_logprobs[0] is None and len(choice.logprobs.top_logprobs[1]) >= 2


def test_vllm_sampling_fields_reach_the_engine(oai: openai.OpenAI) -> None:
    kwargs = {"model": SERVED_NAME, "prompt": "The sea is", "max_tokens": 6}
    greedy = oai.completions.create(**kwargs, temperature=0).choices[0].text
    assert oai.completions.create(**kwargs, seed=5, extra_body={"top_k": 1}).choices[0].text == greedy
    chosen = oai.completions.create(**kwargs, extra_body={"guided_choice": ["calm", "rough"]}).choices[0]
    assert chosen.text in ("calm", "rough") and chosen.finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="min_p"):
        oai.completions.create(**kwargs, extra_body={"min_p": 3})
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        oai.completions.create(**kwargs, extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="(?i)grammar|regex"):
        oai.completions.create(**kwargs, extra_body={"guided_regex": "(unclosed"})


class RejectingEngine:
    """An engine that refuses every request when its generation starts, as it does a bad parameter."""

    def generate(self, prompt_ids, params, request_id):
        async def outputs():
            raise ValueError("refused by the engine")
            yield  # an async generator

        return outputs()

    def abort(self, request_id) -> None:
        pass


def test_a_streamed_echo_the_engine_refuses_is_a_400(live_server: LiveServer) -> None:
    """The echoed prompt was sent before the engine had accepted the request: a 200 stream that broke."""
    import asyncio
    import dataclasses

    from deepinfer_core.entrypoints.completions import CompletionRequest, CompletionRun, _streamed
    from deepinfer_core.sampling_params import SamplingParams

    state = dataclasses.replace(live_server.state, engine=RejectingEngine())
    request = CompletionRequest(SERVED_NAME, [0, 5, 6], "hi", SamplingParams(max_tokens=2), stream=True,
                                include_usage=False, echo=True)
    response = asyncio.run(_streamed(CompletionRun(state, request)))
    assert response.status_code == 400 and b"refused by the engine" in response.body
