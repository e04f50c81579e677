"""Engine outputs -> API response events, through deepseek-recipe's `StreamProcessor`.

The engine's generated ids are pushed as they arrive, minus stop-token ids (recipe would show the EOS
id as literal text); the engine's finish reason is pushed as recipe's finish chunk. Recipe applies stop
sequences itself: once `finished` turns true the caller must stop the engine's request.

Ids whose bytes end in the middle of a UTF-8 character are held back until a later id completes it.
Recipe's processor drops a tokens chunk it cannot decode when the stream ends, so a tail still
incomplete at the end is flushed as a text chunk (lossy, U+FFFD for the partial character, as
DeepSeek's API shows it) that counts its tokens: no text and no token is lost from the usage. A text
chunk carries no logprobs, so the stream adds the flushed ids' entries to the logprobs of Chat
Completions and Responses itself (tail_logprobs.py): there are as many entries as completion tokens.

Recipe counts reasoning tokens by encoding the reasoning text again, which can give more tokens than
were generated (reasoning_tokens 10 of completion_tokens 8). The stream counts them itself, as the
generated ids before thinking ends, and writes that count into the usage it reports.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import deepseek_recipe as dr

from deepinfer_core.chat_contract import PreparedRequest
from deepinfer_recipe.tail_logprobs import TailLogprobs, logprob_entry

if TYPE_CHECKING:
    from deepinfer_recipe.tokenizer import DeepseekTokenizer

PROTOCOLS: dict[str, tuple[Any, Any]] = {
    "chat": (dr.ChatCompletionRequest, dr.ChatCompletionResponse),
    "responses": (dr.ResponsesRequest, dr.ResponsesResponse),
    "messages": (dr.MessagesRequest, dr.MessagesResponse),
}

REPLACEMENT_CHARACTER = "\ufffd"
MAX_INCOMPLETE_IDS = 3
REASONING_END_TOKENS = ("</think>", "｜DSML｜")
"""Tokens that end thinking: its close tag, or the marker of a tool call made while thinking."""
USAGE_DETAILS = {"completion_tokens_details": "completion_tokens", "output_tokens_details": "output_tokens"}
"""Where each API's usage holds `reasoning_tokens`, and the total it is part of."""

FINISH_REASONS = {
    "stop": dr.InferenceFinishReason.Stop,
    "length": dr.InferenceFinishReason.Length,
    "content_filter": dr.InferenceFinishReason.ContentFilter,
}


def sse_frame(event_name: str | None, data: str) -> str:
    """One server-sent event: an `event:` line only when the API names its events."""
    head = f"event: {event_name}\n" if event_name else ""
    return f"{head}data: {data}\n\n"


def _logprob_value(entry: Any) -> float:
    return float(getattr(entry, "logprob", entry))


def _recipe_logprobs(
    token_ids: list[int], logprobs: list[Any], num_top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """vLLM-shaped logprobs (one `{token_id: logprob}` dict per token) -> recipe's `(logprob, top)` pairs."""
    pairs = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        ranked = sorted(((int(t), _logprob_value(v)) for t, v in entry.items()), key=lambda tv: -tv[1])
        chosen = _logprob_value(entry[token_id]) if token_id in entry else float("-inf")
        pairs.append((chosen, ranked[:num_top]))
    return pairs


class RecipeOutputStream:
    """One request's response: feed it the engine's `RequestOutput`s, get SSE frames (or one body).

    :param prepared: the request as `RecipeChatEncoding.prepare` returned it.
    :param response_id: the response id (`chatcmpl-…`, `resp_…`, `msg_…`).
    :param tokenizer: decodes the generated ids.
    :param stop_token_ids: ids that end generation and are never shown to the parser (EOS).
    """

    def __init__(
        self, prepared: PreparedRequest, response_id: str, tokenizer: DeepseekTokenizer, stop_token_ids: list[int]
    ) -> None:
        request_cls, self._response_cls = PROTOCOLS[prepared.api]
        state = prepared.state
        generator = request_cls.chunk_generator(state.conversation_request, response_id, prepared.model)
        if prepared.api == "responses":
            generator = generator.with_echo(state.responses_echo)
            if state.namespace_tool_map:
                generator = generator.with_namespace_tool_map(state.namespace_tool_map)
        self._processor = dr.StreamProcessor(generator, state.conversation_request.parsing_options, tokenizer.recipe)
        self._prepared = prepared
        self._stop_token_ids = frozenset(stop_token_ids)
        self._tokenizer = tokenizer
        self._num_seen = 0
        # Generated ids (stop ids removed) whose text ends mid-character, not yet given to the processor.
        self._held_ids: list[int] = []
        self._held_pairs: list[tuple[float, list[tuple[int, float]]]] = []
        self._reasoning = ReasoningCount(tokenizer, state.conversation_request.parsing_options)
        # The logprobs of a tail flushed mid-character, written into the events and body that carry it.
        self._tail: TailLogprobs | None = None
        self._is_ready = False
        self._is_closed = False
        self._response = None
        if not prepared.stream:
            self._response = self._response_cls(response_id, prepared.model, int(time.time()), 0, 0)

    @property
    def finished(self) -> bool:
        """Whether the response is complete (engine finish, or a stop sequence matched)."""
        return self._processor.finished

    def push(self, output: Any) -> list[str]:
        """Feed one `RequestOutput` (cumulative ids); return the new SSE frames (empty when accumulating)."""
        if self.finished or self._is_closed:
            return []
        events = []
        if not self._is_ready:
            self._is_ready = True
            usage = dr.PromptUsage(
                prompt_tokens=len(self._prepared.prompt_token_ids),
                prompt_cache_hit_tokens=int(getattr(output, "num_cached_tokens", 0) or 0),
            )
            events += self._processor.push(dr.InferenceChunk.ready(prompt_usage=usage))
        completion = output.outputs[0]
        events += self._push_new_tokens(list(completion.token_ids), getattr(completion, "logprobs", None))
        if output.finished and not self._processor.finished:
            events += self._flush_held()
            reason = FINISH_REASONS.get(completion.finish_reason or "stop", dr.InferenceFinishReason.Stop)
            events += self._processor.push(dr.InferenceChunk.finish(reason))
        return self._emit(events)

    def finish(self) -> list[str]:
        """End the response as a normal stop if it has not ended; return the last frames (with `[DONE]`)."""
        frames = [] if self._is_closed else self._emit(self._flush_held() + self._processor.finish())
        done = self._response_cls.sse_done_data()
        if done is not None and self._response is None:
            frames.append(sse_frame(None, done))
        return frames

    def response_json(self) -> str:
        """The accumulated response body (non-streaming requests only)."""
        if self._response is None:
            raise RuntimeError("response_json() is only available for non-streaming requests")
        body = self._response.to_json()
        return self._reasoning.into_usage(self._tail.body_json(body) if self._tail is not None else body)

    def close(self) -> None:
        """Release the parser without a successful completion."""
        if not self._is_closed:
            self._is_closed = True
            self._processor.close()

    def _push_new_tokens(self, token_ids: list[int], logprobs: list[Any] | None) -> list[Any]:
        new_ids = token_ids[self._num_seen:]
        new_logprobs = logprobs[self._num_seen:len(token_ids)] if logprobs and self._prepared.logprobs is not None else None
        self._num_seen = len(token_ids)
        keep = [i for i, token_id in enumerate(new_ids) if token_id not in self._stop_token_ids]
        self._reasoning.add(new_ids[i] for i in keep)
        events = []
        if keep:
            ids = self._held_ids + [new_ids[i] for i in keep]
            pairs = None
            if new_logprobs:
                pairs = self._held_pairs + _recipe_logprobs(ids[len(self._held_ids):], [new_logprobs[i] for i in keep],
                                                            self._prepared.logprobs or 0)
            num_complete = self._num_complete(ids)
            self._held_ids, self._held_pairs = ids[num_complete:], (pairs or [])[num_complete:]
            if num_complete:
                events += self._processor.push(
                    dr.InferenceChunk.tokens(ids[:num_complete], pairs[:num_complete] if pairs else None))
        num_stop = len(new_ids) - len(keep)
        if num_stop and not self._processor.finished:
            # Stop tokens count as generated (usage matches the engine) but carry no text.
            events += self._processor.push(dr.InferenceChunk.text("", num_stop))
        return events

    def _num_complete(self, ids: list[int]) -> int:
        """How many leading `ids` decode to whole characters (the rest end mid-character)."""
        if not self._tokenizer.decode(ids).endswith(REPLACEMENT_CHARACTER):
            return len(ids)
        # A character has at most 4 bytes, so an incomplete one starts in one of the last 3 ids.
        for num_held in range(1, min(len(ids), MAX_INCOMPLETE_IDS) + 1):
            if not self._tokenizer.decode(ids[:-num_held]).endswith(REPLACEMENT_CHARACTER):
                return len(ids) - num_held
        return 0

    def _flush_held(self) -> list[Any]:
        """The held tail, as text with its partial character replaced, counted as its tokens."""
        if not self._held_ids or self._processor.finished:
            return []
        text = self._tokenizer.decode(self._held_ids)
        held_ids, held_pairs = self._held_ids, self._held_pairs
        self._held_ids, self._held_pairs = [], []
        events = self._processor.push(dr.InferenceChunk.text(text, len(held_ids)))
        if held_pairs:
            entries = [logprob_entry(self._tokenizer, token_id, pair) for token_id, pair in zip(held_ids, held_pairs)]
            tail = TailLogprobs(self._prepared.api, events, entries)
            self._tail = tail if tail.has_target else None
        return events

    def _emit(self, events: list[Any]) -> list[str]:
        if self._response is not None:
            for event in events:
                self._response.accumulate(event)
            return []
        name_of = self._response_cls.sse_event_name
        return [sse_frame(name_of(event), self._reasoning.into_usage(self._event_json(event))) for event in events]

    def _event_json(self, event: Any) -> str:
        body = self._tail.event_json(event) if self._tail is not None else None
        return event.to_json() if body is None else body


class ReasoningCount:
    """The generated ids before thinking ends (stop ids excluded): the response's reasoning tokens.

    :param tokenizer: names the ids that end thinking.
    :param options: recipe's parsing options; a response that does not start in thinking has none.
    """

    def __init__(self, tokenizer: DeepseekTokenizer, options: dr.ParsingOptions) -> None:
        stage = options.thinking_initial_stage
        self.is_thinking = stage is not None and stage.starts_in_reasoning() and not options.starts_in_tool_calls
        self.end_ids = {tokenizer.token_to_id(token) for token in REASONING_END_TOKENS} - {None}
        self.count = 0

    def add(self, token_ids) -> None:
        """Count the next generated ids."""
        for token_id in token_ids:
            if not self.is_thinking:
                return
            if token_id in self.end_ids:
                self.is_thinking = False
                return
            self.count += 1

    def into_usage(self, body: str) -> str:
        """`body` (one event or response, JSON) with every `reasoning_tokens` replaced by the count,
        never above the total it is part of."""
        if '"reasoning_tokens"' not in body:
            return body
        data = json.loads(body)
        self._set(data)
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"))

    def _set(self, node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                self._set(item)
        elif isinstance(node, dict):
            for details_key, total_key in USAGE_DETAILS.items():
                details = node.get(details_key)
                if isinstance(details, dict) and "reasoning_tokens" in details:
                    details["reasoning_tokens"] = min(self.count, int(node.get(total_key) or 0))
            for value in node.values():
                self._set(value)
