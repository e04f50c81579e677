"""Request fields the chat encoding does not read, which the server must still honour or refuse.

The chat encoding (deepseek-recipe for DeepSeek-V4) reads what DeepSeek's API reads. Clients written
for OpenAI or vLLM send more: `max_completion_tokens` (what current OpenAI SDKs send instead of
`max_tokens`), OpenAI's penalties and `logit_bias`, and vLLM's extra sampling fields. Each of these is
mapped onto the engine's `SamplingParams` here, or refused with a 400 naming it; none is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.chat_contract import Api, ApiError

SAMPLING_FIELDS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
                   "min_tokens")
"""Body fields passed to `SamplingParams` under the same name (the engine validates their values)."""

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
"""vLLM's older structured-output fields, and the `StructuredOutputsParams` field each one sets."""

REFUSED_FIELDS: dict[str, Any] = {
    "use_beam_search": False, "best_of": 1, "chat_template": None, "chat_template_kwargs": None,
    "add_generation_prompt": True, "continue_final_message": False, "echo": False, "prompt_logprobs": None,
    "guided_whitespace_pattern": None, "stop_token_ids": None, "ignore_eos": False, "allowed_token_ids": None,
    "bad_words": None, "truncate_prompt_tokens": None, "include_stop_str_in_output": False,
}
"""vLLM request fields this server does not implement, with the value that means "off" (accepted)."""


@dataclass
class RequestFields:
    """What the server reads from a body besides what the chat encoding reads."""

    sampling: dict[str, Any] = field(default_factory=dict)
    """`SamplingParams` keyword arguments (top_k, min_p, penalties, logit_bias, min_tokens)."""
    structured_outputs: dict[str, Any] | None = None
    """A `StructuredOutputsParams` as a dict, from `structured_outputs` or a `guided_*` field."""
    max_completion_tokens: int | None = None
    """Chat Completions' `max_completion_tokens`; it wins over `max_tokens`, as in vLLM and OpenAI."""


def _bad(message: str, api: Api) -> ApiError:
    return ApiError.from_message(400, message, api)


def parse_body(raw: bytes) -> dict[str, Any] | None:
    """The body as a dict, or None when it is not a JSON object (the chat encoding answers that)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def read_request_fields(body: dict[str, Any], api: Api, handled: frozenset[str] = frozenset()) -> RequestFields:
    """The extra fields of one request body of `api`.

    :param handled: refused fields the caller implements itself (`echo` on Completions).
    :raises ApiError: 400 naming the field, for a field this server does not implement or a wrong value,
        and for an Anthropic Messages request without `max_tokens` (required there).
    """
    for name, off in REFUSED_FIELDS.items():
        if name not in handled and body.get(name) is not None and body[name] != off:
            raise _bad(f"'{name}' is not supported by this server (only {off!r}).", api)
    if api == "messages" and body.get("max_tokens") is None:
        raise _bad("max_tokens: Field required (Anthropic's Messages API needs it).", api)
    fields = RequestFields(sampling={name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None})
    fields.structured_outputs = _structured_outputs_of(body, api)
    if api == "chat" and body.get("max_completion_tokens") is not None:
        value = body["max_completion_tokens"]
        if type(value) is not int or value < 1:
            raise _bad(f"'max_completion_tokens' must be a positive integer, got {value!r}.", api)
        fields.max_completion_tokens = value
    return fields


def _structured_outputs_of(body: dict[str, Any], api: Api) -> dict[str, Any] | None:
    given = [name for name in ("structured_outputs", *GUIDED_FIELDS) if body.get(name) is not None]
    if len(given) > 1:
        raise _bad(f"Give one structured-output constraint, not {' and '.join(repr(n) for n in given)}.", api)
    if not given:
        return None
    name = given[0]
    if name == "structured_outputs":
        if not isinstance(body[name], dict):
            raise _bad("'structured_outputs' must be an object such as {\"json\": {...}} or {\"regex\": \"...\"}.", api)
        return dict(body[name])
    return {GUIDED_FIELDS[name]: body[name]}


def with_max_completion_tokens(body: dict[str, Any], fields: RequestFields) -> dict[str, Any]:
    """The body the chat encoding reads: `max_completion_tokens`, when given, becomes its `max_tokens`."""
    if fields.max_completion_tokens is None:
        return body
    return {**body, "max_tokens": fields.max_completion_tokens}


__all__ = ["GUIDED_FIELDS", "REFUSED_FIELDS", "SAMPLING_FIELDS", "RequestFields", "parse_body",
           "read_request_fields", "with_max_completion_tokens"]
