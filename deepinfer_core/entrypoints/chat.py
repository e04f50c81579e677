"""`LLM.chat`: OpenAI-style conversations in, vLLM's `RequestOutput`s out, with the parsed message.

The chat encoding registered for the checkpoint's `model_type` (the recipe plugin for DeepSeek-V4)
renders each conversation exactly as the HTTP server's Chat Completions endpoint would, and parses the
generated ids into reasoning, answer text and tool calls. vLLM's `continue_final_message` is DeepSeek's
prefix completion (the last assistant message is continued, not closed).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from deepinfer_core import plugins
from deepinfer_core.chat_contract import ApiError, ChatEncoding, PreparedRequest
from deepinfer_core.outputs import RequestOutput

if TYPE_CHECKING:
    from deepinfer_core.sampling_params import SamplingParams

RECIPE_HINT = f"install the DeepSeek chat format with: {plugins.install_hint('recipe')}"


class ChatEncodingUnavailableError(plugins.PluginError):
    """No installed plugin offers a chat encoding for the checkpoint's model type."""


class ChatRequestError(ValueError):
    """A conversation was rejected (bad message shape, unknown tool, too long for the context...)."""


@dataclass(repr=False)
class ChatOutput(RequestOutput):
    """One conversation's answer: vLLM's `RequestOutput` (prompt ids, `outputs[0].text`, token ids,
    logprobs), plus the assistant message parsed from it."""

    reasoning_content: str | None = None
    """The thinking text (None when thinking is off)."""
    content: str | None = None
    """The answer text."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI-shaped calls: `{"id", "type": "function", "function": {"name", "arguments"}}`."""
    finish_reason: str | None = None
    """`stop`, `length` or `tool_calls`."""
    usage: dict[str, Any] = field(default_factory=dict)
    """Chat Completions usage (prompt, completion, cached and reasoning tokens)."""

    @classmethod
    def of(cls, output: RequestOutput, **parsed: Any) -> ChatOutput:
        """`output` with the parsed message's fields added."""
        return cls(**{f.name: getattr(output, f.name) for f in fields(RequestOutput)}, **parsed)

    @property
    def output(self) -> RequestOutput:
        """The engine's output: this object itself (DeepInfer 0.1 returned it as a separate field)."""
        return self

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message, ready to append to the conversation for the next turn."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


THINKING_KWARGS = ("thinking", "enable_thinking")
"""`chat_template_kwargs` keys that switch thinking mode (DeepSeek's and Qwen's template spellings)."""


@dataclass
class TemplateOptions:
    """vLLM's `LLM.chat` rendering options, as DeepSeek's chat format (rendered by the chat encoding,
    not a Jinja template) honours them."""

    chat_template: str | None = None
    """A Jinja template: not supported (None only)."""
    add_generation_prompt: bool = True
    """Open the assistant's turn after the conversation (DeepSeek's format always does, unless the
    last message is continued)."""
    continue_final_message: bool = False
    """Continue the last (assistant) message instead of closing it: DeepSeek's prefix completion."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Only `thinking` (or `enable_thinking`): True or False, as `thinking=`."""

    def check(self) -> None:
        """:raises ValueError: contradictory options. :raises NotImplementedError: an option not supported."""
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True: a continued "
                             "message is the generation prompt; pass add_generation_prompt=False")
        if self.chat_template is not None:
            raise NotImplementedError("chat_template: a custom chat template (this checkpoint's chat format is "
                                      "its plugin's chat encoding, deepseek-recipe for DeepSeek-V4)")
        if not self.add_generation_prompt and not self.continue_final_message:
            raise NotImplementedError("add_generation_prompt=False without continue_final_message (DeepSeek's "
                                      "chat format always opens the assistant's turn)")
        unknown = sorted(set(self.chat_template_kwargs or {}) - set(THINKING_KWARGS))
        if unknown:
            raise NotImplementedError(f"chat_template_kwargs other than thinking: {unknown} (only "
                                      f"{list(THINKING_KWARGS)} are read)")

    def thinking(self, thinking: bool | None) -> bool | None:
        """`thinking`, or else the one `chat_template_kwargs` gives."""
        given = [v for k, v in (self.chat_template_kwargs or {}).items() if k in THINKING_KWARGS]
        return thinking if thinking is not None or not given else bool(given[0])

    def conversation(self, messages: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
        """`messages` as the chat encoding reads them: a continued last message is marked `prefix`."""
        if not self.continue_final_message:
            return messages
        if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
            raise ChatRequestError(f"conversation {index}: continue_final_message needs an assistant message last")
        return [*messages[:-1], {**messages[-1], "prefix": True}]


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
    thinking: bool | None, context_limit: int, options: TemplateOptions | None = None,
) -> list[PreparedRequest]:
    """Validate and encode every conversation; the first invalid one raises `ChatRequestError`."""
    options = options or TemplateOptions()
    prepared = []
    for index, conversation in enumerate(conversations):
        body = chat_request_body(encoding, options.conversation(conversation, index), tools, options.thinking(thinking))
        try:
            prepared.append(encoding.prepare("chat", body, context_limit))
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
    return ChatOutput.of(
        output,
        reasoning_content=message.get("reasoning_content"),
        content=message.get("content"),
        tool_calls=message.get("tool_calls") or [],
        finish_reason=choice.get("finish_reason"),
        usage=body.get("usage") or {},
    )


def chat(
    llm: Any,
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
    sampling_params: SamplingParams | None = None,
    tools: list[dict[str, Any]] | None = None,
    thinking: bool | None = None,
    use_tqdm: bool = False,
    options: TemplateOptions | None = None,
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
    :param options: vLLM's rendering options (`continue_final_message`...); see `TemplateOptions`.
    :returns: one `ChatOutput` (a `RequestOutput`) per conversation, in order.
    :raises ChatRequestError: a conversation is malformed or too long for the context.
    """
    options = options or TemplateOptions()
    options.check()
    engine = llm.engine
    encoding = chat_encoding_of(llm)
    conversations = [messages] if is_single_conversation(messages) else messages
    prepared = prepare_conversations(encoding, conversations, tools, thinking, engine.config.max_model_len, options)
    prompts = [{"prompt_token_ids": request.prompt_token_ids, "multi_modal_data": {"image": list(request.images)}}
               if request.images else {"prompt_token_ids": request.prompt_token_ids} for request in prepared]
    params = [sampling_params_for(request, sampling_params) for request in prepared]
    decode_sequence, llm.decode_sequence = getattr(llm, "decode_sequence", False), False
    try:  # chat parses RequestOutputs; DeepInfer 0.1's text-only return is for generate
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    finally:
        llm.decode_sequence = decode_sequence
    stop_token_ids = list(getattr(engine, "eos_token_ids", None) or [engine.tokenizer.eos_token_id])
    # an image's placeholder became its span: usage counts the prompt the model saw
    prepared = [replace(request, prompt_token_ids=list(output.prompt_token_ids)) if request.images else request
                for request, output in zip(prepared, outputs)]
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
