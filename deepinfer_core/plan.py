"""The step plan: everything the model side needs to run one step, and the result it hands back.

`Scheduler.schedule()` builds a `StepPlan` from its sequences; an executor sends it to every worker,
whose runner updates its own per-request state from it (`NewRequest` once per admission, then the
per-step `ScheduledRequest`s) and never sees a `Sequence`. Plans hold only plain values (ints,
tuples, strings, `SamplingParams`), so they pickle to another process as they are.

Where later features plug in: draft tokens are extra `token_ids` of a `ScheduledRequest` with
`num_draft_tokens` set (every one of them gets a logits row, and the verifier's accepted counts come
back in `StepResult.num_accepted`); a grammar's next-token mask is not in the plan but the step's
second message (the executor's `sample(grammar_rows)`), one row per logits row of a request whose
`grammar_row` is set; prefix-store transfers are `StepPlan.cache_ops`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from deepinfer_core.sampling_params import SamplingParams

NONFINITE_TOKEN = -2
"""Stands, in a step result, for the token of a row whose logits were not finite: the engine ends that
request with finish reason "error" instead of appending a made-up token."""

PENDING_TOKEN = -1
"""Stands for a token the previous step sampled that the host has not read yet (overlapped decode):
the engine appends it to the sequence, the plan carries it as an input id, and the runner that sampled
it substitutes the real id from its device copy."""


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, laid into its span of positions (`deepinfer_core.multimodal`): positions
    `[offset, offset + length)` take the vision encoder's rows instead of token embeddings."""

    offset: int
    """The span's first position in the prompt."""
    length: int
    """Positions of the span (start, grid rows with their newlines, end)."""
    content_hash: bytes
    """SHA-256 of the processed pixels and their size: the prefix cache's block keys and the encoder
    cache's key."""
    pixel_values: Any = None
    """`[3, height, width]` bf16 pixels, the vision encoder's input."""

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has no state for: just admitted, or readmitted after a preemption."""

    request_id: str
    slot: int
    """Per-request state slot (sliding-window ring, compressor tails)."""
    block_ids: tuple[int, ...]
    """The whole block table at admission (prefix-cache hits included); later steps append."""
    num_prompt_tokens: int
    """The user's prompt length (generated tokens recomputed after a preemption are not prompt)."""
    sampling_params: SamplingParams
    seed: int
    """The sequence's sampling seed in [0, 2**64)."""
    token_ids: tuple[int, ...] = ()
    """Every token so far (prompt, then generated), only for a request whose sampling reads its history
    (penalties, bad words of several tokens: `needs_token_history`); the runner then extends it from
    each step's `token_ids`. Empty otherwise."""
    images: tuple[ImageInput, ...] = ()
    """The prompt's images, in order (none for a text prompt): the runner encodes each once and lays its
    rows into the positions of its span that a step computes."""


@dataclass(frozen=True)
class ReplayRange:
    """A prefix-cache hit's sliding-window replay, decided once at admission
    (`kv.connector.ReplayPolicy.range_for`): positions `[start, hit)` are recomputed to rebuild the
    windows, window attention sees only positions >= `start`, and the cached compressed entries below
    `hit` are never rewritten."""

    exact: bool
    """Exact replay (every layer's window rebuilt: `num_layers` windows back) rather than bounded (one
    window back, SWA Bounded Replay). Only an exact replay's rows may be trimmed layer by layer
    (`models/deepseek_v4/row_trim.replay_keep_from`)."""
    start: int
    """The first recomputed position."""
    hit: int
    """The hit's length in tokens (whole blocks): where the replay ends and the cache's entries stop."""


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's work in one step: compute `token_ids` at positions `start, start + 1, ...`."""

    request_id: str
    start: int
    """Tokens already in the cache (the first position computed now)."""
    token_ids: tuple[int, ...]
    """Ids to compute: a prefill chunk, or the last sampled token (maybe `PENDING_TOKEN`) plus drafts."""
    is_sampled: bool
    """The chunk reaches the sequence's last known token, so the step samples (or verifies) for it."""
    new_block_ids: tuple[int, ...] = ()
    """Blocks appended to the request's table by this step."""
    window_start: int = 0
    """Window attention sees only positions >= this (SWA replay after a prefix hit; 0 normally)."""
    no_write_before: int = 0
    """Compressed entries of windows ending at or before this position are cached and shared: never
    rewrite them (0 normally)."""
    num_draft_tokens: int = 0
    """Trailing `token_ids` that are speculative drafts to verify (0 without speculation)."""
    grammar_row: int | None = None
    """Row of the step's grammar bitmask (`Executor.sample`'s `grammar_rows`) that constrains this request's next token (None: free); with
    drafts, its d + 1 logits rows take rows `grammar_row .. grammar_row + num_draft_tokens`."""
    replay: ReplayRange | None = None
    """The request's window replay while this step computes positions below its hit (None otherwise):
    the scheduler's decision, carried so the runner never infers it from the positions."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """Tokens in the cache once this step ran."""
        return self.start + len(self.token_ids)


CacheOpKind = Literal["load", "save", "save_state", "load_state"]
"""Blocks into / out of the device cache ("load", "save"); a request's state into / out of its slot and
partial last block ("load_state", "save_state")."""
LOAD, SAVE, SAVE_STATE, LOAD_STATE = "load", "save", "save_state", "load_state"
CACHE_OP_KINDS: tuple[str, ...] = get_args(CacheOpKind)
SAVING_KINDS = (SAVE, SAVE_STATE)
"""Ops whose bytes the step result brings back (`StepResult.saved`, one `PendingCopy` each)."""


@dataclass(frozen=True)
class CacheOp:
    """Move whole blocks (or a request's state) between the device cache and the tiers below it; the
    KV connector's scheduler half writes them on the plan, its worker half applies them."""

    kind: CacheOpKind
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    """The blocks' content keys (`deepinfer_core.sched.block_pool.block_key`), one per block; for the
    state kinds, one: the request id."""
    data: Any = None
    """"load": the blocks' bytes, `[len(block_ids), block_bytes]` uint8 on the host (layout:
    `deepinfer_core.kv.blocks`); "load_state": a request's state bytes; None for the saving
    kinds (the step result brings the bytes back)."""
    slot: int | None = None
    """"save_state" / "load_state": the request's state slot (`block_ids`: its partial last block, if any)."""

    def __post_init__(self) -> None:
        if self.kind not in CACHE_OP_KINDS:
            raise ValueError(f"unknown cache op kind {self.kind!r}; expected one of {CACHE_OP_KINDS}")
        if self.kind in (LOAD, SAVE) and len(self.keys) != len(self.block_ids):
            raise ValueError(f"a {self.kind!r} cache op needs one key per block, got {len(self.keys)} keys "
                             f"for {len(self.block_ids)} blocks")
        if self.kind in (SAVE_STATE, LOAD_STATE) and self.slot is None:
            raise ValueError(f"a {self.kind!r} cache op needs the request's slot")
        if self.kind in (LOAD, LOAD_STATE) and self.data is None:
            raise ValueError(f"a {self.kind!r} cache op needs the bytes to load (data)")


@dataclass(frozen=True)
class StepPlan:
    """One step, in the order the runner applies it: forget `freed_request_ids`, add `new_requests`,
    then compute `requests` (logits rows follow this order)."""

    requests: tuple[ScheduledRequest, ...]
    new_requests: tuple[NewRequest, ...] = ()
    freed_request_ids: tuple[str, ...] = ()
    """Requests finished, aborted or preempted since the last plan: the runner drops their state."""
    cache_ops: tuple[CacheOp, ...] = ()
    """Prefix-tier transfers, run in order before the step's tokens (a block saved here may be
    rewritten by this step). A plan may hold only cache ops (no requests)."""
    propose_drafts: bool = True
    """Speculative decoding with a model-side drafter that can pause (DSpark): whether it proposes drafts
    after this step. False when no request's next step is expected to verify any (`Speculator.wants_drafts`):
    the drafter skips its block (keeping its own context caches current) and returns no drafts, so the
    step costs no drafter pass and may be left in flight (overlapped decode). Drafters that cannot pause
    (MTP) draft after every step."""

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def is_all_decodes(self) -> bool:
        """Every request computes exactly its last sampled token and samples the next one."""
        return all(r.is_sampled and r.num_tokens == 1 for r in self.requests)


@dataclass
class EncoderStats:
    """The vision encoder's work in one step (or since the engine started, summed)."""

    num_encoded: int = 0
    """Images run through the encoder."""
    num_cache_hits: int = 0
    """Images whose rows the encoder cache held (not encoded again)."""
    seconds: float = 0.0
    """Wall time of the encoder's runs (the device synchronised around each)."""

    @property
    def num_images(self) -> int:
        return self.num_encoded + self.num_cache_hits

    def add(self, other: EncoderStats) -> None:
        self.num_encoded += other.num_encoded
        self.num_cache_hits += other.num_cache_hits
        self.seconds += other.seconds


@dataclass
class StepResult:
    """What one step produced, as the runner of rank 0 returns it."""

    sampled: list[int]
    """Indices into `plan.requests` that were sampled, in `output` row order."""
    output: Any
    """The sampler's `SamplerOutput` for those rows (None when nothing was sampled)."""
    prompt_logits: dict[int, tuple[int, Any]] = field(default_factory=dict)
    """Per request (index into `plan.requests`) asking for prompt logprobs: (position of the first prompt
    token predicted, fp32 logits `[count, vocab]` predicting the prompt tokens from there on)."""
    num_accepted: list[int] | None = None
    """Per sampled request, how many drafts were accepted (None without speculation)."""
    saved: tuple[Any, ...] = ()
    """Per saving op of `plan.cache_ops` ("save", "save_state"), in order, its bytes on their way to the
    host (`kv_blocks.PendingCopy`: `[n, block_bytes]` uint8 blocks, or a request's state)."""
    drafts: list[tuple[list[int], list[float]]] | None = None
    """Per sampled request, the model-side drafter's next drafts and their confidences (MTP; else None)."""
    encoder: EncoderStats | None = None
    """The vision encoder's work in this step (None: no image rows)."""
