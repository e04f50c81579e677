"""Chat encodings: API request -> conversation -> prompt ids, through deepseek-recipe."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr

from deepinfer_core.chat_contract import Api, ApiError, PreparedRequest, error_body
from deepinfer_core.multimodal.decode import ImageError, image_bytes_from_url
from deepinfer_core.sampling_params import StructuredOutputsParams
from deepinfer_recipe.stream import PROTOCOLS, RecipeOutputStream
from deepinfer_recipe.tokenizer import V41_MODEL_TYPE, DeepseekTokenizer

# Names requests may use for each checkpoint family, besides the name the model is served under.
# Recipe matches names case-sensitively; the lower-case spellings are accepted too.
DEFAULT_MODEL_NAMES = {
    "deepseek_v4": ["DeepSeek-V4-Flash", "DeepSeek-V4-Pro"],
    "deepseek_v41": ["DeepSeek-V4.1-Flash"],
}
# Prompts (and bodies) longer than this many characters per token of context are counted (cheaply)
# before the exact encoding; a smaller body is encoded at once, which costs little.
PRECOUNT_CHARS_PER_TOKEN = 8


@dataclass
class RecipeRequestState:
    """What the output side needs from a converted request (kept in `PreparedRequest.state`)."""

    conversation_request: dr.ConversationRequest
    responses_echo: dr.ResponsesEcho | None = None
    namespace_tool_map: dict[str, tuple[str, str]] | None = None


def _with_lower_case(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        for spelling in (name, name.lower()):
            if spelling not in out:
                out.append(spelling)
    return out


class RecipeChatEncoding:
    """DeepSeek-V4 (`DeepseekV4Encoding`) or V4.1 (`DeepseekV41Encoding`) chat encoding of one checkpoint.

    :param tokenizer: the checkpoint's tokenizer.
    :param model_type: `deepseek_v4` or `deepseek_v41`.
    :param model_names: names requests may use; the first is the served name. Defaults to the
        family's official names.
    """

    def __init__(self, tokenizer: DeepseekTokenizer, model_type: str, model_names: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_type = model_type
        is_v41 = model_type == V41_MODEL_TYPE
        self.model_version = dr.ModelVersion.DeepseekV41Flash if is_v41 else dr.ModelVersion.DeepseekV4Pro
        encoding_cls = dr.DeepseekV41Encoding if is_v41 else dr.DeepseekV4Encoding
        self.encoding = encoding_cls().with_tokenizer(tokenizer.recipe)
        self.model_names = _with_lower_case(list(model_names or []) + DEFAULT_MODEL_NAMES[model_type])
        self.options = dr.ConversionOptions().with_model_versions_by_name(
            {name: self.model_version for name in self.model_names}
        )
        image_spelling = tokenizer.hf.id_to_token(dr.IMAGE_SPECIAL_TOKEN_ID) if is_v41 else None
        if image_spelling is not None:  # V4.1's tokenizer renamed the image token (`<｜deepseek_image｜>`)
            special_tokens = dr.SpecialTokens(image=image_spelling)  # placed by conversion, read by encoding
            self.encoding = self.encoding.with_special_tokens(special_tokens)
            self.options = self.options.with_special_tokens(special_tokens)

    def with_model_names(self, model_names: list[str]) -> RecipeChatEncoding:
        """The same encoding, serving under `model_names[0]` and accepting every name in `model_names`."""
        return RecipeChatEncoding(self.tokenizer, self.model_type, model_names)

    def encode(self, conversation: dr.Conversation) -> list[int]:
        """Prompt ids of `conversation`; special-token spellings inside message text stay plain text."""
        return self.encoding.encode(conversation)

    def prepare(self, api: Api, body: bytes | dict[str, Any], context_limit: int) -> PreparedRequest:
        """Parse, validate and encode one request body of `api`.

        :raises ApiError: with `api`'s status and error shape when the request is invalid.
        """
        if api not in PROTOCOLS:
            raise ValueError(f"unknown API {api!r}; expected one of {sorted(PROTOCOLS)}")
        request_cls = PROTOCOLS[api][0]
        try:
            if self.model_type != V41_MODEL_TYPE and _has_image_parts(body):
                raise ApiError.from_message(400, f"this model ({self.model_type}) takes text only, not images", api)
            request = request_cls(body)
            model = request.model
            state = self._read_state(api, request)
            conversation_request = request.convert(self.options)
            images = self._images(conversation_request.conversation, api)
            if not isinstance(body, (bytes, str)) or len(body) > PRECOUNT_CHARS_PER_TOKEN * context_limit:
                self._reject_too_long(conversation_request.conversation, context_limit, api)
            prompt_token_ids = self.encode(conversation_request.conversation)
            max_tokens = conversation_request.resolve_max_tokens(len(prompt_token_ids), context_limit)
            structured_outputs = _structured_outputs(conversation_request.inference_options.output_constraint)
        except dr.ConversionError as exc:
            raise ApiError(exc.status_code, _reshape_error_body(exc.status_code, exc.body, api)) from exc
        except ValueError as exc:
            raise ApiError.from_message(400, str(exc), api) from exc
        state.conversation_request = conversation_request
        options = conversation_request.inference_options
        return PreparedRequest(
            api=api,
            model=model,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            stream=conversation_request.stream,
            temperature=1.0 if options.temperature is None else options.temperature,
            top_p=1.0 if options.top_p is None else options.top_p,
            seed=options.seed,
            logprobs=(options.top_logprobs or 0) if options.logprobs else None,
            structured_outputs=structured_outputs,
            images=images,
            state=state,
        )

    def open_stream(self, prepared: PreparedRequest, response_id: str, stop_token_ids: list[int]) -> RecipeOutputStream:
        """Start the response of `prepared` (streamed as SSE frames, or accumulated into one body)."""
        return RecipeOutputStream(prepared, response_id, self.tokenizer, stop_token_ids)

    def _read_state(self, api: Api, request: Any) -> RecipeRequestState:
        # Responses settings must be read before `convert` consumes the request.
        state = RecipeRequestState(conversation_request=None)  # type: ignore[arg-type]
        if api == "responses":
            state.responses_echo = request.echo()
            state.namespace_tool_map = request.namespace_tool_map(self.options)
        return state

    def _reject_too_long(self, conversation: dr.Conversation, context_limit: int, api: Api) -> None:
        """Refuse a prompt that cannot fit the context before the exact encoding tokenizes all of it.

        A prompt of many characters a token's worth of context is counted first, a piece at a time,
        stopping as soon as it passes the limit (the count is a lower bound of the exact one: the
        plain tokenizer reads special-token spellings in message text as one token, recipe as text).
        """
        prompt = self.encoding.render_conversation(conversation).prompt
        if len(prompt) <= PRECOUNT_CHARS_PER_TOKEN * context_limit:
            return
        if self.tokenizer.encode_within(prompt, context_limit - 1) is None:
            raise ApiError.from_message(
                400, f"This model's maximum context length is {context_limit} tokens; the prompt has more "
                f"than {context_limit - 1} (one position is left for the answer). Shorten the conversation.", api)

    def _images(self, conversation: dr.Conversation, api: Api) -> tuple[bytes, ...]:
        """The conversation's images, encoded, in the order of their placeholders in the prompt (OpenAI
        `image_url` parts, Anthropic `image` blocks, Responses `input_image` items). Only inline images
        are taken (data: URLs, base64): nothing is fetched. DeepSeek-V4 takes no images."""
        if not any(message.image_sources for message in conversation.messages):
            return ()
        return tuple(_image_bytes(source, api) for source in self.encoding.render_conversation(conversation).image_sources)


IMAGE_PART_TYPES = frozenset({"image_url", "image", "input_image"})
"""The content-part types that carry an image: OpenAI Chat, Anthropic Messages, Responses."""


def _has_image_parts(body: bytes | str | dict[str, Any]) -> bool:
    """Whether a request body holds an image part anywhere (recipe renders V4's as placeholder text)."""
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except ValueError:
            return False  # recipe answers the malformed body with its own 400
    stack: list[Any] = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("type") in IMAGE_PART_TYPES:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _image_bytes(source: dr.ImageSource, api: Api) -> bytes:
    """One image source's encoded bytes; a URL to fetch or a malformed data URL is a 400."""
    where = f" ({source.path.lstrip('.')})" if source.path else ""
    try:
        if source.kind == "bytes" and source.data is not None:
            return bytes(source.data)
        return image_bytes_from_url(source.data_url if source.kind == "data_url" else source.url)
    except ImageError as err:
        raise ApiError.from_message(400, f"{err}{where}", api) from err


def _structured_outputs(constraint: dr.OutputConstraint | None) -> StructuredOutputsParams | None:
    """The engine's constraint for recipe's `response_format` (json_schema, json_object, regex); recipe
    has already put the schema into the prompt as DeepSeek's API does. JSON is compact (`", "` and
    `": "` between tokens, no free whitespace): a model can never loop on whitespace, and the answer
    parses the same. Tool-call constraints stay unenforced, as before (recipe parses the calls)."""
    if constraint is None:
        return None
    if constraint.kind == "json":  # an empty schema is json_object: any object
        if not constraint.schema:
            return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
        return StructuredOutputsParams(json=constraint.schema, disable_any_whitespace=True)
    if constraint.kind == "regex":
        return StructuredOutputsParams(regex=constraint.schema)
    return None


def _reshape_error_body(status_code: int, body: str, api: Api) -> str:
    """Recipe's error bodies, in the core's shape for `api`: Anthropic clients expect
    `{"type": "error", ...}`, and OpenAI-shaped bodies get the same fields and `code` as every other
    error the server answers (recipe sets `code` to the type on some errors, null on others)."""
    try:
        error = json.loads(body)["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = body, None
    reshaped = error_body(status_code, message, api)
    if param is not None and api != "messages":
        reshaped["error"]["param"] = param
    return json.dumps(reshaped)
