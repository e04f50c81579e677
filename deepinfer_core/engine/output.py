"""Output processing: when a completion stops, its logprob entries, and its final text."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from deepinfer_core.backends.sampling import SamplerOutput
from deepinfer_core.outputs import Logprob
from deepinfer_core.sampling_params import SamplingParams


def check_stop(
    params: SamplingParams,
    token_id: int,
    num_generated_after: int,
    eos_token_ids: Sequence[int],
    max_model_len_reached: bool,
) -> str | None:
    """Decide whether a completion ends with the token just appended.

    A stop token or EOS wins over length, as in vLLM; neither counts before `min_tokens`. When the
    result is "stop" and `token_id` is in `params.stop_token_ids`, that id is the `stop_reason`.

    :param params: the request's parameters.
    :param token_id: the token just appended.
    :param num_generated_after: tokens generated including `token_id`.
    :param eos_token_ids: the model's end-of-sequence ids.
    :param max_model_len_reached: the sequence now fills the context.
    :returns: "stop", "length" or None to continue.
    """
    if num_generated_after >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop"
    return "length" if ends_by_length(params, num_generated_after, max_model_len_reached) else None


def ends_by_length(params: SamplingParams, num_generated: int, max_model_len_reached: bool) -> bool:
    """Whether a completion with `num_generated` tokens is done by length (`max_tokens` or the context)."""
    return max_model_len_reached or (params.max_tokens is not None and num_generated >= params.max_tokens)


def build_logprobs_entry(
    output: SamplerOutput,
    row: int,
    num_logprobs: int,
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """Turn row `row` of a sampler output into vLLM's per-step logprobs dict.

    The sampled token comes first, then the `num_logprobs` most likely tokens (rank 1 first); a
    sampled token that is among them appears once. Bring `output` to the host once before calling this
    for every row: as CPU tensors, or faster, with every field as lists (`tensor.tolist()`).

    :param output: the step's `SamplerOutput` (tensors or lists).
    :param row: the batch row.
    :param num_logprobs: this request's `SamplingParams.logprobs` (0 for the sampled token only).
    :param decode: token id -> text, to fill `Logprob.decoded_token`; None leaves it None.
    :returns: token id -> `Logprob`.
    """
    sampled_id = int(output.token_ids[row])
    entries = {sampled_id: (float(output.logprobs[row]), int(output.ranks[row]))}
    if num_logprobs > 0:
        top_token_ids, top_logprobs = output.top_token_ids, output.top_logprobs
        if top_token_ids is None or top_logprobs is None or len(top_token_ids[row]) < num_logprobs:
            raise ValueError(f"sampler output holds fewer than the {num_logprobs} top logprobs requested")
        top_ids, top_values = _as_list(top_token_ids[row][:num_logprobs]), _as_list(top_logprobs[row][:num_logprobs])
        for rank, (token_id, value) in enumerate(zip(top_ids, top_values, strict=True), start=1):
            entries.setdefault(token_id, (value, rank))
    return {
        token_id: Logprob(logprob=value, rank=rank, decoded_token=decode(token_id) if decode else None)
        for token_id, (value, rank) in entries.items()
    }


def _as_list(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else values


def finished_text(text: str, token_ids: list[int], stop_reason: int | str | None, params: SamplingParams,
                  decode: Callable[[list[int], bool], str]) -> str:
    """A finished completion's text under `skip_special_tokens` and `include_stop_str_in_output`.

    :param text: the engine's text: special tokens skipped, cut before a matched stop string.
    :param token_ids: the completion's ids.
    :param stop_reason: the matched stop string (or stop id, or None).
    :param params: the request's parameters.
    :param decode: `(ids, skip_special_tokens) -> text`.
    """
    stop = stop_reason if isinstance(stop_reason, str) else None
    if not params.skip_special_tokens:
        full = decode(token_ids, False)
        cut = full.find(stop) if stop is not None else -1
        text = full if cut < 0 else full[:cut]
    return text + stop if stop is not None and params.include_stop_str_in_output else text
