"""`POST /v1/completions`: OpenAI's Completions API as vLLM serves it — a raw prompt (text or token
ids), no chat template, the engine's own detokenized text and stop strings.

Supported: `model`, `prompt` (a string, a list of token ids, or a one-element list of either),
`max_tokens` (default 16), `temperature`, `top_p`, `seed`, `stop`, `stream` with
`stream_options.include_usage`, `logprobs` (top-k count), `echo` (the prompt, and with `logprobs` its
tokens' logprobs, first), and vLLM's extra fields (`top_k`, `min_p`, penalties, `structured_outputs` and
`guided_*`; see `request_fields.py`). `n`, `best_of` other than 1, batched prompts, `suffix` and
`logit_bias` are refused with a 400 that says so.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from deepinfer_core.chat_contract import ApiError
from deepinfer_core.engine.async_engine import EngineDeadError
from deepinfer_core.entrypoints.errors import api_error_response, error_response
from deepinfer_core.entrypoints.generation import (
    CLIENT_CLOSED_REQUEST,
    compile_grammar,
    traffic_class_of,
    until_done_or_disconnect,
)
from deepinfer_core.entrypoints.limits import ClientGone, check_prompt_bytes, read_body
from deepinfer_core.entrypoints.pd import kv_transfer_of
from deepinfer_core.entrypoints.request_fields import read_request_fields

if TYPE_CHECKING:
    from deepinfer_core.entrypoints.serve import ServerState
    from deepinfer_core.sampling_params import SamplingParams

METRICS_API = "completions"
UNSUPPORTED = {"suffix": None, "logit_bias": None, "n": 1, "best_of": 1}
HANDLED = frozenset({"echo", "best_of"})
"""vLLM fields `request_fields.py` refuses for chat that Completions answers itself."""


@dataclass
class CompletionRequest:
    """A validated Completions request."""

    model: str
    prompt_token_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool


def _bad(message: str) -> ApiError:
    return ApiError.from_message(400, message, "chat")


def _prompt_of(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad("Batched prompts are not supported: send one prompt per request.")
    raise _bad("'prompt' must be a non-empty string or a non-empty list of token ids.")


def encode_prompt(state: ServerState, prompt: str | list[int]) -> tuple[list[int], str | None]:
    """Token ids of `prompt` (text gets the model's BOS in front, as `LLM.generate` does) and its text."""
    if not isinstance(prompt, str):
        vocab_size = state.vocab_size
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt):
            raise _bad(f"Prompt token ids must be in [0, {vocab_size}).")
        return list(prompt), None
    if state.tokenizer is None:
        raise _bad("This checkpoint has no tokenizer: send the prompt as token ids.")
    encode_within = getattr(state.tokenizer, "encode_within", None)
    if encode_within is None:  # a plain tokenizer: at least the byte bound before the whole encode
        check_prompt_bytes(prompt, state.context_limit, state.max_token_bytes, "chat")
        ids = state.tokenizer.encode(prompt)
    else:  # stops as soon as the prompt cannot fit (the last position is for one new token)
        ids = encode_within(prompt, state.context_limit - 1)
    if ids is None:
        raise _bad(f"This model's maximum context length is {state.context_limit} tokens; the prompt has more. "
                   "Shorten the prompt.")
    bos = state.bos_token_id
    return ([bos, *ids] if bos is not None and (not ids or ids[0] != bos) else ids), prompt


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise _bad(f"The body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise _bad("The body must be a JSON object.")
    return body


def _check_supported(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if not isinstance(model, str) or model not in state.encoding.model_names:
        raise _bad(f"The model `{model}` does not exist; this server serves {state.encoding.model_names[0]!r}.")
    for name, allowed in UNSUPPORTED.items():
        value = body.get(name, allowed)
        if value != allowed and not (name == "logit_bias" and value == {}):
            raise _bad(f"'{name}' is not supported by this server (only {allowed!r}).")


def _max_tokens(body: dict[str, Any], num_prompt_tokens: int, context_limit: int) -> int:
    """`max_tokens` (OpenAI's default 16; null: up to the end of the context), checked against the context."""
    room = context_limit - num_prompt_tokens
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise _bad("'max_tokens' must be a positive integer.")
    if room < 1 or (max_tokens or 0) > room:
        raise _bad(f"This model's maximum context length is {context_limit} tokens. However, you requested "
                   f"{num_prompt_tokens + (max_tokens or 0)} tokens ({num_prompt_tokens} in the prompt, "
                   f"{max_tokens or 0} for the completion).")
    return max_tokens or room


def _default(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else value


def parse_request(state: ServerState, raw: bytes) -> CompletionRequest:
    """Validate a Completions body and encode its prompt.

    :raises ApiError: 400 in OpenAI's error shape.
    """
    from deepinfer_core.sampling_params import SamplingParams

    body = _json_object(raw)
    _check_supported(state, body)
    fields = read_request_fields(body, "chat", handled=HANDLED)
    fields.sampling.pop("logit_bias", None)  # refused above unless empty
    prompt_ids, prompt_text = encode_prompt(state, _prompt_of(body))
    max_tokens = _max_tokens(body, len(prompt_ids), state.context_limit)
    echo = bool(body.get("echo"))
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=_default(body, "temperature", 1.0), top_p=_default(body, "top_p", 1.0),
            seed=body.get("seed"), stop=body.get("stop") or None, logprobs=body.get("logprobs"),
            prompt_logprobs=body.get("logprobs") if echo else None,  # echo shows the prompt's logprobs too
            structured_outputs=fields.structured_outputs, **fields.sampling)
    except (ValueError, TypeError, NotImplementedError) as err:
        raise _bad(str(err)) from err
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return CompletionRequest(body["model"], prompt_ids, prompt_text, params, bool(body.get("stream")),
                             include_usage, echo)


class CompletionRun:
    """One Completions request through the engine: text deltas, then usage."""

    def __init__(self, state: ServerState, request: CompletionRequest) -> None:
        self.state, self.request = state, request
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.sent = 0  # characters of the completion text already sent
        self.num_logprobs_sent = 0
        self.last_output: Any = None
        self.arrival = time.monotonic()
        # While generating, hold back what could still turn out to be the start of a stop string.
        self.hold_back = max((len(stop) for stop in request.params.stop or ()), default=1) - 1

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Completion chunks (text deltas), the last with the finish reason."""
        request, outcome = self.request, "aborted"
        outputs = self.state.engine.generate(request.prompt_token_ids, request.params, self.id)
        is_echo_pending = request.echo
        try:
            async for output in outputs:
                self.last_output = output
                if is_echo_pending:  # after the first output: the engine accepted the request, logprobs are in
                    is_echo_pending = False
                    yield self._choice(self._prompt_text(), self._prompt_logprobs(output), None)
                completion = output.outputs[0]
                text = completion.text if output.finished else completion.text[:max(0, len(completion.text) - self.hold_back)]
                if len(text) > self.sent or output.finished:
                    delta, self.sent = text[self.sent:], max(self.sent, len(text))
                    yield self._choice(delta, self._new_logprobs(completion), completion.finish_reason)
            outcome = "ok"
        finally:
            self.state.engine.abort(self.id)
            await outputs.aclose()
            self.state.metrics.record_request(METRICS_API, outcome, len(request.prompt_token_ids), self.last_output,
                                              self.arrival)

    def _prompt_text(self) -> str:
        if self.request.prompt_text is not None:
            return self.request.prompt_text
        tokenizer = self.state.tokenizer
        return tokenizer.decode(self.request.prompt_token_ids, skip_special_tokens=True) if tokenizer else ""

    def usage(self) -> dict[str, int]:
        num_prompt = len(self.request.prompt_token_ids)
        num_completion = len(self.last_output.outputs[0].token_ids) if self.last_output is not None else 0
        return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion}

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.request.model,
                "choices": choices, **extra}

    def _choice(self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _new_logprobs(self, completion: Any) -> dict[str, Any] | None:
        if self.request.params.logprobs is None or completion.logprobs is None:
            return None
        start, self.num_logprobs_sent = self.num_logprobs_sent, len(completion.logprobs)
        return self._logprobs_of(completion.token_ids[start:], completion.logprobs[start:])

    def _prompt_logprobs(self, output: Any) -> dict[str, Any] | None:
        """The echoed prompt's logprobs (the first token has none: it has no context), as vLLM gives them."""
        if self.request.params.prompt_logprobs is None or output.prompt_logprobs is None:
            return None
        return self._logprobs_of(output.prompt_token_ids, output.prompt_logprobs)

    def _logprobs_of(self, token_ids: list[int], entries: list[dict[int, Any] | None]) -> dict[str, Any]:
        tokens, token_logprobs, top = [], [], []
        tokenizer = self.state.tokenizer
        for token_id, entry in zip(token_ids, entries):
            chosen = entry.get(token_id) if entry is not None else None
            if chosen is not None and chosen.decoded_token is not None:
                tokens.append(chosen.decoded_token)
            else:
                tokens.append(tokenizer.decode([token_id]) if tokenizer is not None else "")
            token_logprobs.append(chosen.logprob if chosen is not None else None)
            top.append({(lp.decoded_token or str(t)): lp.logprob for t, lp in entry.items()} if entry is not None else None)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top}


async def handle_completions(state: ServerState, request: Request) -> Response:
    """Serve one `POST /v1/completions`."""
    try:
        raw = await read_body(request, state.limits, "chat")
        parsed = await run_in_threadpool(parse_request, state, raw)
        parsed.params.traffic_class = traffic_class_of(request)  # checked by the engine (400 if unknown)
        parsed.params.kv_transfer_params = kv_transfer_of(request)
        if parsed.params.structured_outputs is not None:
            await compile_grammar(state, parsed.params, "chat")
    except ApiError as err:
        state.metrics.count_request(METRICS_API, "error")
        return api_error_response(err)
    except ClientGone:
        state.metrics.count_request(METRICS_API, "aborted")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    run = CompletionRun(state, parsed)
    if parsed.stream:
        return await _streamed(run)
    collected: list[dict[str, Any]] = []

    async def collect() -> None:
        async for chunk in run.chunks():
            collected.append(chunk)

    work = asyncio.ensure_future(collect())
    if not await until_done_or_disconnect(work, request):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        work.result()
    except (ValueError, EngineDeadError) as err:
        return error_response(400 if isinstance(err, ValueError) else 503, str(err), "chat")
    return Response(json.dumps(run.envelope([_merge(collected)], usage=run.usage())), media_type="application/json")


def _merge(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The choices of every chunk as one choice."""
    merged = {"index": 0, "text": "".join(c["text"] for c in chunks), "logprobs": None,
              "finish_reason": chunks[-1]["finish_reason"] if chunks else None}
    parts = [c["logprobs"] for c in chunks if c["logprobs"]]
    if parts:
        merged["logprobs"] = {key: [v for part in parts for v in part[key]] for key in parts[0]}
    return merged


async def _streamed(run: CompletionRun) -> Response:
    chunks = run.chunks()
    try:
        first = await anext(chunks, None)  # a request the engine rejects still gets its status
    except (ValueError, EngineDeadError) as err:
        return error_response(400 if isinstance(err, ValueError) else 503, str(err), "chat")

    async def frames() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield f"data: {json.dumps(run.envelope([first]))}\n\n"
            async for chunk in chunks:
                yield f"data: {json.dumps(run.envelope([chunk]))}\n\n"
            if run.request.include_usage:
                yield f"data: {json.dumps(run.envelope([], usage=run.usage()))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await chunks.aclose()

    body = frames()
    return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(body.aclose))


__all__ = ["CompletionRequest", "CompletionRun", "encode_prompt", "handle_completions", "parse_request"]
