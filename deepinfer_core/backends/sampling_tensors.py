"""Building the sampler's inputs: a step's `SamplingTensors` from its rows' `SamplingParams`, and the
host-to-device helpers every step's inputs use.

Seeds and token indices are the engine's: row `i` draws its token number `num_generated[i]` (0 for
the first generated token) under `seeds[i]`. The engine picks a random seed for a request without
`SamplingParams.seed`, and gives each of a request's `n` completions a different seed.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from deepinfer_core.backends.sampling import SamplingTensors, SparseTokenValues, TokenPenalties
from deepinfer_core.sampling_params import SamplingParams

_TYPECODES = {torch.int64: "q", torch.float32: "f"}


def host_tensor(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D host tensor of `values` (int64 or float32), built ~3x faster than `torch.tensor(values)`."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)


_ALIGN = 16


def to_device(segments: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """One int64 tensor per list, all on `device` through a single host-to-device copy."""
    flat, bounds = [], []
    for values in segments:
        start = len(flat)
        flat += values
        bounds.append((start, len(flat)))
        flat += [0] * (-len(flat) % _ALIGN)
    buffer = host_tensor(flat).to(device, non_blocking=True)
    return [buffer[a:b] for a, b in bounds]


def seed_to_int64(seed: int) -> int:
    """The int64 holding the same 64 bits as the unsigned seed (seeds are in [0, 2**64))."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def banned_token_ids(params: SamplingParams, num_generated: int, eos_token_ids: Sequence[int],
                     output_token_ids: Sequence[int] = ()) -> list[int]:
    """Token ids a row may not draw next: EOS and stop ids until `min_tokens` tokens exist, and the last
    token of each bad word whose other tokens end `output_token_ids`."""
    banned: list[int] = []
    if num_generated < params.min_tokens:
        banned.extend(params.stop_token_ids)
        if not params.ignore_eos:
            banned.extend(t for t in eos_token_ids if t not in banned)
    for ids in params.bad_words_token_ids or ():
        prefix = ids[:-1]
        is_match = not prefix or (len(output_token_ids) >= len(prefix) and list(output_token_ids[-len(prefix):]) == prefix)
        if is_match and ids[-1] not in banned:
            banned.append(ids[-1])
    return banned


def holds_at_later_positions(tensors: SamplingTensors, params: Sequence[SamplingParams]) -> bool:
    """Whether `tensors` (built for `params`' rows) stay right for the same rows at later positions with
    only `steps` moved: no row has penalties (they read the history), banned ids now (a reached
    `min_tokens` stays reached) or bad words (their bans follow the history)."""
    return (tensors.penalties is None and tensors.banned_token_ids is None
            and not any(p.bad_words_token_ids for p in params))


def prepare_sampling_tensors(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    num_generated: Sequence[int],
    eos_token_ids: Sequence[int],
    device: torch.device,
    vocab_size: int | None = None,
    *,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
) -> SamplingTensors:
    """Build one step's `SamplingTensors`; row `i` is `params[i]`.

    :param params: each row's request parameters.
    :param seeds: each row's seed in [0, 2**64) (the request's `seed`, or one the engine drew).
    :param num_generated: tokens each row has generated so far (= index of the token being drawn).
    :param eos_token_ids: the model's end-of-sequence ids (shared by every row).
    :param device: where the sampler runs.
    :param vocab_size: the logit width; given, the tensors carry `host_flags` (which filters any row uses).
        Penalties need it.
    :param output_token_ids: each row's generated ids so far (penalties and bad words of several
        tokens read them; None when no row has either).
    :param prompt_token_ids: each row's prompt ids (`repetition_penalty` reads them; None when no row has one).
    :returns: the step's `SamplingTensors`; greedy rows get temperature 0.
    :raises ValueError: a row needs `output_token_ids`, `prompt_token_ids` or `vocab_size` not given.
    """
    if not len(params) == len(seeds) == len(num_generated):
        raise ValueError(
            f"params, seeds and num_generated must have one entry per row, got "
            f"{len(params)}, {len(seeds)} and {len(num_generated)}"
        )
    banned = None
    if any(n < p.min_tokens or p.bad_words_token_ids for p, n in zip(params, num_generated)):
        histories = output_token_ids if output_token_ids is not None else [()] * len(params)
        if output_token_ids is None and any(len(ids) > 1 for p in params for ids in p.bad_words_token_ids or ()):
            raise ValueError("bad_words of several tokens need output_token_ids")
        banned = [banned_token_ids(p, n, eos_token_ids, h) for p, n, h in zip(params, num_generated, histories, strict=True)]
    # Two host-to-device copies in all, built on the host first (each copy waits for the device stream).
    floats = [0.0 if p.is_greedy else p.temperature for p in params]
    floats += [p.top_p for p in params]
    floats += [p.min_p for p in params]
    ints = [p.top_k for p in params]
    ints += [seed_to_int64(seed) for seed in seeds]
    ints += num_generated
    rows = len(params)
    temperature, top_p, min_p = host_tensor(floats, torch.float32).to(device, non_blocking=True).view(3, rows).unbind(0)
    top_k, seed_values, steps = host_tensor(ints).to(device, non_blocking=True).view(3, rows).unbind(0)
    return SamplingTensors(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=seed_values,
        steps=steps,
        num_logprobs=max((p.logprobs or 0 for p in params), default=0),
        banned_token_ids=banned if banned is not None and any(banned) else None,
        needs_logprobs=any(p.logprobs is not None for p in params),
        host_flags=None if vocab_size is None else _host_flags(params, vocab_size),
        allowed_token_ids=_allowed_token_ids(params, device),
        logit_bias=_logit_bias(params, device),
        penalties=_penalties(params, output_token_ids, prompt_token_ids, vocab_size, device),
    )


def _allowed_token_ids(params: Sequence[SamplingParams], device: torch.device) -> SparseTokenValues | None:
    if not any(p.allowed_token_ids for p in params):
        return None
    rows = [row for row, p in enumerate(params) for _ in p.allowed_token_ids or ()]
    ids = [t for p in params for t in p.allowed_token_ids or ()]
    index = host_tensor(rows + ids).to(device, non_blocking=True).view(2, -1)
    return SparseTokenValues(rows=index[0], token_ids=index[1])


def _logit_bias(params: Sequence[SamplingParams], device: torch.device) -> SparseTokenValues | None:
    if not any(p.logit_bias for p in params):
        return None
    entries = [(row, t, v) for row, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
    index = host_tensor([e[0] for e in entries] + [e[1] for e in entries]).to(device, non_blocking=True).view(2, -1)
    values = host_tensor([e[2] for e in entries], torch.float32).to(device, non_blocking=True)
    return SparseTokenValues(rows=index[0], token_ids=index[1], values=values)


def _penalties(
    params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]] | None,
    prompt_token_ids: Sequence[Sequence[int]] | None, vocab_size: int | None, device: torch.device,
) -> TokenPenalties | None:
    is_penalised = [bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1) for p in params]
    if not any(is_penalised):
        return None
    needs_prompt = any(p.repetition_penalty != 1 for p in params)
    if output_token_ids is None or vocab_size is None or (needs_prompt and prompt_token_ids is None):
        raise ValueError("penalties need vocab_size and output_token_ids (and prompt_token_ids for repetition_penalty)")
    floats = [p.presence_penalty for p in params] + [p.frequency_penalty for p in params]
    floats += [p.repetition_penalty for p in params]
    presence, frequency, repetition = host_tensor(floats, torch.float32).to(device, non_blocking=True).view(3, -1).unbind(0)
    return TokenPenalties(
        presence=presence, frequency=frequency, repetition=repetition,
        output_token_ids=_padded(output_token_ids, is_penalised, vocab_size, device),
        prompt_token_ids=_padded(prompt_token_ids, [p.repetition_penalty != 1 for p in params], vocab_size, device)
        if needs_prompt else None,
    )


def _padded(rows: Sequence[Sequence[int]], is_used: list[bool], pad: int, device: torch.device) -> torch.Tensor:
    """`[B, L]` int64 of the used rows' ids, padded with `pad` (unused rows are all padding)."""
    width = max((len(ids) for ids, used in zip(rows, is_used, strict=True) if used), default=0)
    flat = [t for ids, used in zip(rows, is_used) for t in (list(ids) + [pad] * (width - len(ids)) if used else [pad] * width)]
    return host_tensor(flat).to(device, non_blocking=True).view(len(is_used), width)


def _host_flags(params: Sequence[SamplingParams], vocab_size: int) -> tuple[bool, bool, bool]:
    drawing = [p for p in params if not p.is_greedy]
    return (
        bool(drawing),
        any(0 < p.top_k < vocab_size or p.top_p < 1 for p in drawing),
        any(p.min_p > 0 for p in drawing),
    )
