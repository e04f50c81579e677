"""Structured output over HTTP: Chat Completions `response_format` and Responses `text.format`, through
the official `openai` SDK against the live server (the real engine on the embedded tiny model)."""

from __future__ import annotations

import json
import threading

import openai
import pytest

from tests.entrypoints.live import SERVED_NAME, LiveServer

jsonschema = pytest.importorskip("jsonschema")

NO_THINKING = {"thinking": {"type": "disabled"}}
# Answers are short even from random weights: enums, a bounded integer, compact JSON.
COLOR = {"type": "object", "properties": {"c": {"type": "string", "enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c", "n"]}
USER = [{"role": "user", "content": "Pick a color, as json."}]


def json_schema(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


@pytest.fixture(scope="module")
def oai(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0)


def test_chat_json_schema_answers_validate(oai: openai.OpenAI) -> None:
    for seed in range(3):
        response = oai.chat.completions.create(model=SERVED_NAME, messages=USER, max_tokens=48, seed=seed,
                                               response_format=json_schema(COLOR), extra_body=NO_THINKING)
        assert response.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(response.choices[0].message.content), COLOR)


def test_chat_json_schema_streams_the_same_answer(oai: openai.OpenAI) -> None:
    kwargs = {"model": SERVED_NAME, "messages": USER, "max_tokens": 16, "seed": 5,
              "response_format": json_schema(COLOR, strict=False), "extra_body": NO_THINKING}
    whole = oai.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), COLOR)


def test_responses_text_format_json_schema(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model=SERVED_NAME, input="Pick a color, as json.", max_output_tokens=48,
                                    reasoning={"effort": "none"}, text={"format": {
                                        "type": "json_schema", "name": "answer", "schema": COLOR, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), COLOR)


def test_json_object_is_accepted_and_keeps_the_json_word_rule(oai: openai.OpenAI) -> None:
    response = oai.chat.completions.create(model=SERVED_NAME, messages=USER, max_tokens=4, extra_body=NO_THINKING,
                                           response_format={"type": "json_object"})
    assert response.choices[0].message.content.lstrip()[:1] == "{"  # the grammar's first token
    with pytest.raises(openai.BadRequestError, match="json"):
        oai.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Pick a color."}],
                                    max_tokens=4, response_format={"type": "json_object"}, extra_body=NO_THINKING)


# valid JSON Schema to recipe's check, but no value can match it: xgrammar refuses it
EMPTY_RANGE = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}


def test_bad_schema_is_a_400_with_xgrammars_message(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="minimum greater than maximum") as err:
        oai.chat.completions.create(model=SERVED_NAME, messages=USER, max_tokens=4,
                                    response_format=json_schema(EMPTY_RANGE), extra_body=NO_THINKING)
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="minimum greater than maximum"):
        oai.responses.create(model=SERVED_NAME, input="json please", max_output_tokens=4, text={"format": {
            "type": "json_schema", "name": "answer", "schema": EMPTY_RANGE}})


def test_a_compile_timeout_is_a_400(oai: openai.OpenAI, live_server: LiveServer, monkeypatch) -> None:
    manager = live_server.engine.structured_output
    compiler, release = manager._get_compiler(), threading.Event()
    monkeypatch.setattr(manager, "compile_timeout_s", 0.1)
    monkeypatch.setattr(manager, "_get_compiler", lambda: release.wait() and compiler)
    try:
        with pytest.raises(openai.BadRequestError, match="took longer than 0.1 s"):
            oai.chat.completions.create(model=SERVED_NAME, messages=USER, max_tokens=4, extra_body=NO_THINKING,
                                        response_format=json_schema({"type": "object", "properties": {"m": {"type": "integer"}}}))
    finally:
        release.set()
