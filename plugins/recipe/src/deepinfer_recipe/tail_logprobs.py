"""Logprob entries of a flushed tail: the ids an answer ended with in the middle of a UTF-8 character.

Recipe's processor gets such a tail as a text chunk (its text holds U+FFFD for the partial character),
and a text chunk carries no logprobs, so the stream writes the tail's entries in itself: every API then
has as many logprob entries as the usage counts output tokens. An entry is shaped as recipe shapes the
entries of ids it decoded itself (OpenAI's convention): `bytes` holds the id's raw bytes, and `token` its
text when those bytes are whole UTF-8, else each byte escaped as `\\xNN`.

- Chat Completions: the entries go under the delta field that got the tail's text (`content` or
  `reasoning_content`) of the chunk that carries it, and of the whole response.
- Responses: the entries go into the `output_text` part that got the tail's text, everywhere that part's
  logprobs appear: its `response.output_text.delta` event, the `.done` events after it, the final
  `response.completed`/`response.incomplete` event, and the whole response.
"""

from __future__ import annotations

import json
from typing import Any

LogprobPair = tuple[float, list[tuple[int, float]]]
"""Recipe's logprobs of one id: its own, and the top ids' `(id, logprob)`."""


def token_text(raw: bytes) -> str:
    """An id's `token` field: its text when its bytes are whole UTF-8, else every byte as `\\xNN`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(f"\\x{byte:02x}" for byte in raw)


def logprob_entry(tokenizer: Any, token_id: int, pair: LogprobPair) -> dict[str, Any]:
    """One id's entry, with its top alternatives, in the OpenAI shape both APIs share."""
    logprob, top = pair

    def entry(tid: int, value: float) -> dict[str, Any]:
        raw = bytes(tokenizer.token_bytes(tid))
        return {"token": token_text(raw), "logprob": value, "bytes": list(raw)}

    return {**entry(token_id, logprob), "top_logprobs": [entry(t, v) for t, v in top]}


def _dump(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class TailLogprobs:
    """Where a flushed tail's entries go, and the events and bodies with them written in.

    :param api: the API of the response (`chat` or `responses`; others carry no logprobs).
    :param events: recipe's events for the tail's text chunk.
    :param entries: the tail's entries (`logprob_entry`), one per id.
    """

    def __init__(self, api: str, events: list[Any], entries: list[dict[str, Any]]) -> None:
        self.api = api
        self.entries = entries
        self.tail_events = events
        self.chat_key: str | None = None
        self.part: tuple[str, int] | None = None  # Responses: (item id, content index) of the text part
        for event in events:
            data = json.loads(event.to_json())
            if api == "chat":
                delta = (data.get("choices") or [{}])[0].get("delta") or {}
                self.chat_key = next((k for k in ("content", "reasoning_content") if delta.get(k)), None)
                if self.chat_key is not None:
                    return
            elif data.get("type") == "response.output_text.delta" and data.get("delta"):
                self.part = (data["item_id"], int(data["content_index"]))
                return

    @property
    def has_target(self) -> bool:
        """Whether the tail's text went where the API shows logprobs (not, e.g., a Responses reasoning item)."""
        return self.chat_key is not None or self.part is not None

    def event_json(self, event: Any) -> str | None:
        """`event` (emitted at or after the flush) with the entries written in; None when it holds none
        of the tail's places. A Chat Completions tail is written into its own chunk only, once."""
        if self.api == "chat":
            if not any(event is tail for tail in self.tail_events):
                return None
            body = self.body_json(event.to_json())
            self.chat_key = None  # one chunk carries them
            return body
        return self.body_json(event.to_json())

    def body_json(self, body: str) -> str:
        """`body` (an event, or the whole response) with the entries added where the tail's text is."""
        if self.chat_key is not None:
            data = json.loads(body)
            choice = data["choices"][0]
            logprobs = choice.get("logprobs") or {}
            logprobs[self.chat_key] = (logprobs.get(self.chat_key) or []) + self.entries
            choice["logprobs"] = logprobs
            return _dump(data)
        if self.part is None or f'"{self.part[0]}"' not in body:
            return body
        data = json.loads(body)
        self._add_to_part(data)
        return _dump(data)

    def _add_to_part(self, node: Any) -> None:
        """Append the entries to every place in `node` that holds the tail's text part's logprobs."""
        item_id, content_index = self.part  # type: ignore[misc]
        if isinstance(node, list):
            for value in node:
                self._add_to_part(value)
            return
        if not isinstance(node, dict):
            return
        if node.get("item_id") == item_id and node.get("content_index") == content_index:
            # output_text.delta / output_text.done hold `logprobs`; content_part.done its `part`'s.
            holder = node if "logprobs" in node else node.get("part")
            if isinstance(holder, dict):
                holder["logprobs"] = (holder.get("logprobs") or []) + self.entries
            return
        if node.get("id") == item_id and isinstance(node.get("content"), list):
            parts = node["content"]
            if content_index < len(parts) and isinstance(parts[content_index], dict):
                parts[content_index]["logprobs"] = (parts[content_index].get("logprobs") or []) + self.entries
            return
        for value in node.values():
            self._add_to_part(value)
