"""Prompt-lookup (n-gram) drafting: match the request's last n tokens earlier in its own prompt and
output, and propose what followed that earlier occurrence.

Agent traffic repeats itself (tool outputs quoted back, code edited in place), so a continuation seen
before is often the continuation now. Longer matches are tried first; among occurrences of one n-gram
the most recent wins.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(token_ids: Sequence[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram (`max_n` down to `min_n` tokens) of `token_ids`; empty when no suffix recurs.

    :param token_ids: the request's prompt then generated tokens.
    :param num_drafts: most tokens to propose.
    :param min_n: shortest suffix matched.
    :param max_n: longest suffix matched.
    """
    total = len(token_ids)
    if num_drafts < 1:
        return []
    ids = list(token_ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = ids[total - n :]
        # latest occurrence that ends before the suffix itself starts to overlap the end
        for start in range(total - n - 1, -1, -1):
            if ids[start : start + n] == suffix:
                follow = ids[start + n : start + n + num_drafts]
                if follow:
                    return follow
    return []
