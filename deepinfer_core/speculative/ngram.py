"""Prompt-lookup (n-gram) drafting: match the request's last n tokens earlier in its own prompt and
output, and propose what followed that earlier occurrence.

Agent traffic repeats itself (tool outputs quoted back, code edited in place), so a continuation seen
before is often the continuation now. Longer matches are tried first; among occurrences of one n-gram
the most recent wins.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = 4
"""Bytes per token id in the searched buffer (int32: every vocabulary fits)."""


def propose_ngram(token_ids: Sequence[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram (`max_n` down to `min_n` tokens) of `token_ids`; empty when no suffix recurs.

    The search runs in C (`bytes.rfind` over the ids as int32), so a long context costs microseconds.

    :param token_ids: the request's prompt then generated tokens.
    :param num_drafts: most tokens to propose.
    :param min_n: shortest suffix matched.
    :param max_n: longest suffix matched.
    """
    total = len(token_ids)
    if num_drafts < 1 or total < 2:
        return []
    data = array("i", token_ids).tobytes()
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pattern = data[(total - n) * _ITEM :]
        limit = (total - 1) * _ITEM  # an occurrence must end before the last token
        while (found := data.rfind(pattern, 0, limit)) >= 0:
            if found % _ITEM == 0:  # aligned on a token, not inside one
                start = found // _ITEM + n
                return list(token_ids[start : start + num_drafts])
            limit = found + len(pattern) - 1
    return []
