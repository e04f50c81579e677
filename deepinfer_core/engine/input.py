"""Input validation: what a request's `SamplingParams` cannot check alone, checked against the model
before the request is queued."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_core.backends.sampling_tensors import banned_token_ids
from deepinfer_core.sampling_params import SamplingParams, history_fields, needs_token_history

if TYPE_CHECKING:
    from deepinfer_core.tokenizer import Tokenizer


def check_sampling_params(
    params: SamplingParams, vocab_size: int, tokenizer: Tokenizer | None = None,
    eos_token_ids: Sequence[int] = (), *, token_history: bool = False,
) -> None:
    """Check what `SamplingParams` cannot check alone, before a request is queued; resolve `bad_words`.

    :param params: the request's parameters; `params.bad_words_token_ids` is set from `bad_words`.
    :param vocab_size: the model's vocabulary size; every id the request names must be below it.
    :param tokenizer: the checkpoint's tokenizer (`bad_words` need it).
    :param eos_token_ids: the model's end-of-sequence ids.
    :param token_history: whether the runner passes each row's generated (and prompt) ids to
        `prepare_sampling_tensors`; penalties and bad words of several tokens need them.
    :raises ValueError: an id outside the vocabulary, `bad_words` without a tokenizer, or an allowed set
        that `min_tokens` bans whole.
    :raises NotImplementedError: penalties or multi-token bad words while `token_history` is False.
    """
    named = {"stop_token_ids": params.stop_token_ids, "allowed_token_ids": params.allowed_token_ids or [],
             "logit_bias": list(params.logit_bias or {})}
    for name, ids in named.items():
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} has ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words need the checkpoint's tokenizer (none found); use logit_bias or allowed_token_ids")
        params.bad_words_token_ids = bad_words_token_ids(params.bad_words, tokenizer)
    if params.allowed_token_ids and params.min_tokens > 0:
        banned = set(banned_token_ids(params, 0, eos_token_ids))
        if banned.issuperset(params.allowed_token_ids):
            raise ValueError("every allowed_token_ids entry is an EOS or stop id, banned until min_tokens; "
                             "allow other ids or lower min_tokens")
    if not token_history and needs_token_history(params):
        needs = ", ".join(name for name in history_fields(params) if name)
        raise NotImplementedError(f"{needs}: the engine does not pass generated ids to the sampler yet")


def bad_words_token_ids(words: Sequence[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Each bad word as token ids, alone and after a space (the spaced form only when it is a different
    sequence of the same length, so the space is part of the word's first token), as vLLM does."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip())
        spaced = tokenizer.encode(" " + word.lstrip())
        for ids in (plain, spaced):
            is_spaced_variant = ids is spaced
            if not ids or ids in sequences:
                continue
            if is_spaced_variant and (len(ids) != len(plain) or ids[0] == plain[0]):
                continue
            sequences.append(ids)
    return sequences
