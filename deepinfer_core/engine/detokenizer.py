"""Incremental detokenization: the text of a growing token list at O(1) tokenizer work per new token."""

from __future__ import annotations

from deepinfer_core.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"  # what a tokenizer yields for a UTF-8 sequence cut in the middle


class IncrementalText:
    """Decodes only a short window (`prefix`..end) of the ids each time, and appends what is new.

    Text whose last character is incomplete UTF-8 is held back until the next token completes it.
    `update` takes the same list grown by appends only; a call with no new id returns the text as is.

    :param tokenizer: decodes with `skip_special_tokens=True`.
    :param token_texts: a cache of single-token decodes, shared by every instance on the same
        tokenizer (a step usually decodes one token alone, then it and the new token together).
    """

    def __init__(self, tokenizer: Tokenizer, token_texts: dict[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.token_texts = {} if token_texts is None else token_texts
        self.text = ""
        self.prefix = self.read = 0
        self.num_ids = 0

    def update(self, ids: list[int]) -> str:
        if len(ids) == self.num_ids:
            return self.text
        self.num_ids = len(ids)
        decode = self.tokenizer.decode
        if self.read - self.prefix == 1:
            token = ids[self.prefix]
            before = self.token_texts.get(token)
            if before is None:
                before = self.token_texts[token] = decode([token], skip_special_tokens=True)
        else:
            before = decode(ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(ids)
        return self.text
