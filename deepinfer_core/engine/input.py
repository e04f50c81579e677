"""Input validation: a request's prompt and what its `SamplingParams` cannot check alone, checked against
the model in one pass (`InputProcessor.process`) before the request is queued."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from deepinfer_core.backends.sampling_tensors import banned_token_ids
from deepinfer_core.kv.nixl_transfer import first_token_of
from deepinfer_core.sampling_params import SamplingParams, history_fields, needs_token_history

if TYPE_CHECKING:
    from deepinfer_core.kv.tiers import PrefixTiers
    from deepinfer_core.structured_output.manager import StructuredOutputManager
    from deepinfer_core.tokenizer import Tokenizer


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raise `ValueError` for an empty prompt, ids outside the vocabulary or one too long."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty; give at least one token")
    if set(map(type, prompt_token_ids)) == {int}:  # the usual case, checked in C: ~10x faster at 8K ids
        bad = [] if 0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab_size else [
            t for t in prompt_token_ids if not 0 <= t < vocab_size]
    else:
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is {max_model_len} "
            "(prompt + at least one new token); shorten the prompt or raise max_model_len"
        )


def check_image_layout(config) -> None:
    """Image input runs on one rank so far: refuse it under tensor, data, context or expert parallelism."""
    layout = {"tensor_parallel_size": config.tensor_parallel_size, "data_parallel_size": config.data_parallel_size,
              "context_parallel_size": config.context_parallel_size}
    named = [f"{k}={v}" for k, v in layout.items() if v > 1]
    if config.enable_expert_parallel:
        named.append("enable_expert_parallel=True")
    if named:
        raise NotImplementedError(f"image input with parallelism: {', '.join(named)} (images run on a single "
                                  "rank so far)")


class InputProcessor:
    """Checks a request against the model before anything is queued.

    :param vocab_size: the model's vocabulary size.
    :param max_model_len: a prompt leaves room for at least one new token.
    :param tokenizer: the checkpoint's tokenizer (stop strings and bad words need it).
    :param eos_token_ids: the model's end-of-sequence ids.
    :param prefix_tiers: the prefix cache's tiers (their store names the traffic classes), or None.
    :param structured_output: compiles the grammars of constrained requests.
    """

    def __init__(self, vocab_size: int, max_model_len: int, tokenizer: Tokenizer | None,
                 eos_token_ids: Sequence[int], prefix_tiers: PrefixTiers | None,
                 structured_output: StructuredOutputManager) -> None:
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.prefix_tiers, self.structured_output = prefix_tiers, structured_output

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise `ValueError` for an empty prompt, ids outside the vocabulary or one too long."""
        check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)

    def check_images(self, prompt_token_ids: list[int], images, params: SamplingParams) -> None:
        """Raise `ValueError` for images whose spans do not lie, in order and apart, inside the prompt, and
        `NotImplementedError` for a prefill/decode transfer of an image prompt (not carried yet)."""
        end = 0
        for image in images:
            if image.offset < end or image.length < 1 or image.end > len(prompt_token_ids):
                raise ValueError(f"image spans must lie in order inside the prompt's {len(prompt_token_ids)} "
                                 f"tokens; got one at [{image.offset}, {image.end})")
            end = image.end
        if getattr(params, "kv_transfer_params", None) is not None:
            raise NotImplementedError("image input with prefill/decode disaggregation: send image prompts to an "
                                      "instance without --role")

    def process(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[int | None, Future | None]:
        """Check the prompt and `params` (resolving `bad_words`), then submit the request's grammar.

        :returns: the first token a prefill instance sampled (`kv_transfer_params`) or None, and the
            grammar's compile or None.
        :raises ValueError: anything the request asks that this model or configuration cannot give.
        :raises GrammarError: structured outputs without a tokenizer, or an invalid grammar.
        """
        self.validate_prompt(prompt_token_ids)
        check_sampling_params(params, self.vocab_size, self.tokenizer, self.eos_token_ids, token_history=True)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the checkpoint's tokenizer (none found); use stop_token_ids")
        store = self.prefix_tiers.store if self.prefix_tiers is not None else None
        if store is not None and params.traffic_class is not None and params.traffic_class not in store.ttl_s:
            raise ValueError(f"traffic_class {params.traffic_class!r} is not configured; classes: {sorted(store.ttl_s)}")
        first = first_token_of(params, self.vocab_size)
        grammar = self.structured_output.submit(params.structured_outputs) if params.structured_outputs else None
        return first, grammar


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
        # internal: every engine front passes token_history=True
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
