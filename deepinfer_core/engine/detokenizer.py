"""Incremental detokenization: the text of a growing token list at O(1) tokenizer work per new token."""

from __future__ import annotations

from deepinfer_core.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"  # what a tokenizer yields for a UTF-8 sequence cut in the middle


class IncrementalText:
    """Decodes only a short window (`prefix`..end) of the ids each time, and appends what is new.

    Text whose last character is incomplete UTF-8 is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix = self.read = 0

    def update(self, ids: list[int]) -> str:
        decode = self.tokenizer.decode
        before = decode(ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(ids)
        return self.text
