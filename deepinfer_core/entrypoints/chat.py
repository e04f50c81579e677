"""`LLM.chat`: OpenAI-style conversations in, parsed assistant messages out.

The chat encoding registered for the checkpoint's `model_type` (the recipe plugin for DeepSeek-V4)
renders each conversation exactly as the HTTP server's Chat Completions endpoint would, and parses the
generated ids into reasoning, answer text and tool calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepinfer_core import plugins
from deepinfer_core.chat_contract import ApiError, ChatEncoding, PreparedRequest

if TYPE_CHECKING:
    from deepinfer_core.outputs import RequestOutput
    from deepinfer_core.sampling_params import SamplingParams

RECIPE_HINT = 'install the DeepSeek chat format with: pip install "deepinfer[recipe]"'


class ChatEncodingUnavailableError(plugins.PluginError):
    """No installed plugin offers a chat encoding for the checkpoint's model type."""


class ChatRequestError(ValueError):
    """A conversation was rejected (bad message shape, unknown tool, too long for the context...)."""


@dataclass
class ChatOutput:
    """One conversation's answer: the parsed assistant message plus the raw engine output."""

    reasoning_content: str | None
    """The thinking text (None when thinking is off)."""
    content: str | None
    """The answer text."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI-shaped calls: `{"id", "type": "function", "function": {"name", "arguments"}}`."""
    finish_reason: str | None = None
    """`stop`, `length` or `tool_calls`."""
    usage: dict[str, Any] = field(default_factory=dict)
    """Chat Completions usage (prompt, completion, cached and reasoning tokens)."""
    output: RequestOutput | None = None
    """The engine's output (prompt ids, generated ids, logprobs)."""

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message, ready to append to the conversation for the next turn."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def load_chat_encoding(tokenizer: Any, model_config: Any) -> ChatEncoding:
    """The chat encoding the installed plugins offer for `model_config.model_type`.

    :raises ChatEncodingUnavailableError: nobody registered one, or the registered factory declined.
    """
    model_type = getattr(model_config, "model_type", None)
    factories = plugins.chat_encodings()
    factory = factories.get(model_type)
    if factory is None:
        known = ", ".join(sorted(factories)) or "none"
        raise ChatEncodingUnavailableError(
            f"no chat encoding for model_type {model_type!r} (registered: {known}); {RECIPE_HINT}"
        )
    encoding = factory(tokenizer, model_config)
    if encoding is None:
        raise ChatEncodingUnavailableError(
            f"the chat encoding for {model_type!r} cannot use tokenizer {type(tokenizer).__name__}; {RECIPE_HINT}"
        )
    return encoding


def chat_request_body(
    encoding: ChatEncoding, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
    thinking: bool | None,
) -> dict[str, Any]:
    """A Chat Completions body for one conversation (the model name is the served one)."""
    body: dict[str, Any] = {"model": encoding.model_names[0], "messages": messages}
    if tools:
        body["tools"] = tools
    if thinking is not None:
        body["thinking"] = {"type": "enabled" if thinking else "disabled"}
    return body


def is_single_conversation(messages: list[Any]) -> bool:
    """`[{"role": ...}, ...]` is one conversation; `[[...], [...]]` is several."""
    return not messages or isinstance(messages[0], dict)


def prepare_conversations(
    encoding: ChatEncoding, conversations: list[list[dict[str, Any]]], tools: list[dict[str, Any]] | None,
    thinking: bool | None, context_limit: int,
) -> list[PreparedRequest]:
    """Validate and encode every conversation; the first invalid one raises `ChatRequestError`."""
    prepared = []
    for index, conversation in enumerate(conversations):
        try:
            prepared.append(encoding.prepare("chat", chat_request_body(encoding, conversation, tools, thinking),
                                             context_limit))
        except ApiError as err:
            raise ChatRequestError(f"conversation {index}: {_error_message(err.body)}") from err
    return prepared


def sampling_params_for(prepared: PreparedRequest, sampling_params: SamplingParams | None) -> SamplingParams:
    """The caller's parameters when given (max_tokens clamped to the context), else the encoding's defaults."""
    from deepinfer_core.sampling_params import SamplingParams

    if sampling_params is None:
        return SamplingParams(max_tokens=prepared.max_tokens, temperature=prepared.temperature,
                              top_p=prepared.top_p, seed=prepared.seed, structured_outputs=prepared.structured_outputs)
    params = sampling_params.clone()
    if params.max_tokens is None or params.max_tokens > prepared.max_tokens:
        params.max_tokens = prepared.max_tokens
    return params


def parse_output(encoding: ChatEncoding, prepared: PreparedRequest, output: RequestOutput,
                 stop_token_ids: list[int]) -> ChatOutput:
    """Parse one finished engine output into a `ChatOutput`."""
    stream = encoding.open_stream(prepared, f"chatcmpl-{uuid.uuid4().hex}", stop_token_ids)
    stream.push(output)
    stream.finish()
    body = json.loads(stream.response_json())
    choice = body["choices"][0]
    message = choice["message"]
    return ChatOutput(
        reasoning_content=message.get("reasoning_content"),
        content=message.get("content"),
        tool_calls=message.get("tool_calls") or [],
        finish_reason=choice.get("finish_reason"),
        usage=body.get("usage") or {},
        output=output,
    )


def chat(
    llm: Any,
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
    sampling_params: SamplingParams | None = None,
    tools: list[dict[str, Any]] | None = None,
    thinking: bool | None = None,
    use_tqdm: bool = False,
) -> list[ChatOutput]:
    """Answer one conversation (a list of messages) or several (a list of lists), batched together.

    Messages and tools use the OpenAI Chat Completions shapes (assistant `reasoning_content` and
    `tool_calls`, `tool` results with `tool_call_id`).

    :param llm: an `LLM`; its `generate` runs the encoded prompts.
    :param sampling_params: applied to every conversation (`max_tokens` clamped to what the context
        leaves); None uses the chat format's defaults (temperature 1 in thinking mode, `max_tokens` up
        to the context).
    :param tools: OpenAI function tools offered in every conversation.
    :param thinking: True or False switches thinking mode; None keeps the model's default (on).
    :returns: one `ChatOutput` per conversation, in order.
    :raises ChatRequestError: a conversation is malformed or too long for the context.
    """
    engine = llm.engine
    encoding = chat_encoding_of(llm)
    conversations = [messages] if is_single_conversation(messages) else messages
    prepared = prepare_conversations(encoding, conversations, tools, thinking, engine.config.max_model_len)
    prompts = [{"prompt_token_ids": request.prompt_token_ids} for request in prepared]
    params = [sampling_params_for(request, sampling_params) for request in prepared]
    decode_sequence, llm.decode_sequence = getattr(llm, "decode_sequence", False), False
    try:  # chat parses RequestOutputs; DeepInfer 0.1's text-only return is for generate
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    finally:
        llm.decode_sequence = decode_sequence
    stop_token_ids = list(getattr(engine, "eos_token_ids", None) or [engine.tokenizer.eos_token_id])
    return [parse_output(encoding, request, output, stop_token_ids) for request, output in zip(prepared, outputs)]


def chat_encoding_of(llm: Any) -> ChatEncoding:
    """The `LLM`'s chat encoding, looked up once and kept on the object."""
    encoding = getattr(llm, "_chat_encoding", None)
    if encoding is None:
        encoding = load_chat_encoding(llm.engine.tokenizer, llm.engine.model_config)
        llm._chat_encoding = encoding
    return encoding


def _error_message(body: str) -> str:
    try:
        parsed = json.loads(body)
        return parsed["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body
