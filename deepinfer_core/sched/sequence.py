"""One request's tokens and cache bookkeeping, as the scheduler, the block manager and the runner see it.

A `Sequence` is created by the engine, queued by `Scheduler.add`, given cache blocks and a state slot
by the scheduler, advanced by `Scheduler.postprocess`, and extended by the engine with
`append_token`. The fields say exactly which tokens are already in the cache, so any step can resume
(chunked prefill, recompute after preemption, replay after a prefix-cache hit).
"""

from __future__ import annotations

import enum
import secrets
import time
from typing import TYPE_CHECKING

from deepinfer_core.plan import PENDING_TOKEN, ImageInput, ReplayRange
from deepinfer_core.sampling_params import needs_token_history

if TYPE_CHECKING:
    from deepinfer_core.sampling_params import SamplingParams

_SEED_BITS = 64


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    """Queued; holds no blocks and no slot (new, or preempted for recompute)."""
    RUNNING = "running"
    """Holds cache blocks and a state slot; scheduled every step it fits."""
    FINISHED_STOPPED = "stopped"
    """Ended by an end-of-sequence or stop token."""
    FINISHED_LENGTH = "length"
    """Ended by `max_tokens`, `max_model_len`, or a cache too small to ever hold it."""
    FINISHED_ABORTED = "aborted"
    """Cancelled by the caller."""
    FINISHED_ERROR = "error"
    """Ended because the model's logits for its next token were not finite (NaN or infinite)."""

    @property
    def is_finished(self) -> bool:
        """True for the three FINISHED_* states."""
        return self not in _UNFINISHED  # read for every request every step: identity tests, no name check


_UNFINISHED = (SequenceStatus.WAITING, SequenceStatus.RUNNING)


class Sequence:
    """A request's token ids plus what of them is already in the cache.

    Invariant: `0 <= num_computed_tokens <= num_tokens`. The runner computes
    `token_ids[num_computed_tokens : num_computed_tokens + n]` for the `n` the scheduler grants, and a
    token is sampled when that chunk reaches `num_tokens` (the newest token has no cache state yet).

    :param request_id: unique id of the request (also the id `Scheduler.abort` takes).
    :param prompt_token_ids: the prompt; must not be empty.
    :param sampling_params: how to pick tokens; only `seed` is read here.
    :param prompt: the prompt text, when there is one, for outputs.
    :param seed: per-request seed; defaults to `sampling_params.seed`, else a random 64-bit seed.
    :param arrival_time: `time.time()` at arrival; defaults to now.
    :param defers_grammar_mask: its grammar's mask may be filled after its step's forward is queued
        (overlapped decode, any executor: `StructuredOutputManager.plan_rows`), so a grammar alone does
        not make it wait for its last token on the host.
    :param images: the prompt's images, each laid into its span of `prompt_token_ids`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        seed: int | None = None,
        arrival_time: float | None = None,
        defers_grammar_mask: bool = False,
        images: tuple[ImageInput, ...] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; give at least one token")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.images = tuple(images)
        """The prompt's images (their spans, pixels and content hashes); the prefix cache keys cover them."""
        self.sampling_params = sampling_params
        self.needs_token_history = needs_token_history(sampling_params)
        """Its sampling reads its own ids (penalties): the runner is sent them."""
        kv_transfer = getattr(sampling_params, "kv_transfer_params", None)
        has_grammar = getattr(sampling_params, "structured_outputs", None) is not None
        exports = kv_transfer is not None and kv_transfer.export
        self.takes_drafts = not (self.needs_token_history or exports)
        """Speculative drafts may be verified for it: its sampling does not read its own ids and its
        state is not exported (a grammar does not stop them: each draft's row gets its own mask)."""
        self.needs_host_token = self.needs_token_history or (has_grammar and not defers_grammar_mask) or exports
        """Its next step needs its last token on the host (penalties, a grammar's mask filled before
        launch; a prefill instance's request, whose state is exported as its first token was sampled):
        with overlapped decode it sits out the step launched while that token is still on the device."""
        if seed is None:
            seed = getattr(sampling_params, "seed", None)
        self.seed = seed if seed is not None else secrets.randbits(_SEED_BITS)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        """Leading tokens whose state (window, compressor tails, compressed entries) is in the cache."""
        self.block_table: list[int] = []
        """Cache block ids; block i covers positions [block_size * i, block_size * (i + 1))."""
        self.num_planned_blocks = 0
        """Leading `block_table` entries already sent to the runner in a step plan."""
        self.slot: int | None = None
        """Per-request state slot (sliding-window ring, compressor tails) while running, else None."""
        self.num_cached_tokens = 0
        """Prefix-cache hit length of the latest admission, reported to the user (0 if none)."""
        self.replay_start = 0
        """Window attention of recomputed tokens sees only positions >= this (SWA replay; 0 normally)."""
        self.replay: ReplayRange | None = None
        """The window replay its prefix hit decided (`kv.connector.KvConnector.admit`), or None."""
        self.no_write_before = 0
        """Compressed entries of windows ending at or before this position are already cached (shared
        with other requests): the runner must not write them (0 normally)."""
        self.is_loading = False
        """Waiting while its prefix blocks are read from the prefix store (`KvConnector.is_prefix_ready`)."""
        self.draft_token_ids: list[int] = []
        """Speculative decoding: drafts the model side proposed to follow `token_ids` (MTP), if any."""
        self.draft_confidences: list[float] | None = None
        """The drafter's per-draft survival probabilities for `draft_token_ids` (None: none given)."""

    # -- token counts ------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy), without a trailing `PENDING_TOKEN`."""
        ids = self.token_ids[len(self.prompt_token_ids) :]
        if ids and ids[-1] == PENDING_TOKEN:
            ids.pop()
        return ids

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next sample (1 while decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    # -- state ---------------------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def waits_for_host(self) -> bool:
        """Its last token is still on the device and its next step needs it on the host (see
        `needs_host_token`): it is not scheduled until the step in flight is settled."""
        return self.needs_host_token and self.token_ids[-1] == PENDING_TOKEN

    @property
    def is_prefill(self) -> bool:
        """True while more than one token is uncomputed (a prompt, a replay, or a recompute).

        A sequence with exactly one uncomputed token is decoding: the next step computes that token
        and samples. This is a property of the counts alone, so a prefill chunk that stops one token
        short of the end is finished as a decode.
        """
        return self.num_uncomputed_tokens > 1

    def append_token(self, token_id: int) -> None:
        """Add a sampled token (or `PENDING_TOKEN`); it is computed (enters the cache) in the next step."""
        self.token_ids.append(token_id)

    def resolve_pending(self, token_id: int) -> None:
        """Replace the trailing `PENDING_TOKEN` with the sampled id."""
        if self.token_ids[-1] != PENDING_TOKEN:
            raise RuntimeError(f"{self!r} has no pending token to resolve")
        self.token_ids[-1] = token_id

    def reset_cache_state(self) -> None:
        """Forget everything the cache held for this sequence (preemption, or an undone admission).

        The token ids are kept, so the next admission recomputes prompt + generated tokens exactly.
        `block_table` is cleared by `BlockPool.free`, which must run first.
        """
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.replay_start = 0
        self.replay = None
        self.no_write_before = 0
        self.num_planned_blocks = 0
        self.slot = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, slot={self.slot})"
        )
