"""The user's speculative-decoding options (vLLM's spelling of `speculative_config`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from deepinfer_core.config.family import ConfigError

MAX_SPECULATIVE_TOKENS = 16
"""Largest `num_speculative_tokens` accepted (the per-request rings must hold k + 1 rows of one step)."""


MODEL_DRAFTERS = ("mtp", "dspark")
"""Methods whose drafter is part of the checkpoint (`ModelCapabilities.drafters` says which a model carries);
the others ("ngram") draft from the request's own tokens and fit any model."""


class SpeculativeConfig(BaseModel):
    """How to speculate: which drafter, how many drafts, and how verification picks them.

    `LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3})` or
    `deepinfer serve --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'`, or on a
    DeepSeek-V4.1 checkpoint `{"method": "dspark", "num_speculative_tokens": 5}`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "mtp", "dspark"] = Field(
        description='"ngram": prompt lookup over the request\'s own tokens; "mtp": DeepSeek-V4\'s '
        'multi-token-prediction layer (needs `mtp.*` weights); "dspark": DeepSeek-V4.1\'s block drafter '
        "(its `mtp.*` stages and confidence head; k <= the checkpoint's `dspark_block_size`).")
    num_speculative_tokens: PositiveInt = Field(
        description="Most drafts verified per request and step (k). dspark: one draft per slot of its block "
        "(the anchor and dspark_block_size - 1 noise tokens, each slot drafting the token after it), so at "
        "most dspark_block_size.")
    prompt_lookup_min: PositiveInt = Field(1, description="ngram: shortest suffix n-gram matched.")
    prompt_lookup_max: PositiveInt = Field(3, description="ngram: longest suffix n-gram matched (tried first).")
    draft_length_policy: Literal["fixed", "confidence"] = Field(
        "confidence",
        description='"confidence" (default): per request, verify '
        "only drafts whose estimated survival pays for their verification cost (`policy.py`; dspark: its "
        "confidence head's output, calibrated online per slot against observed acceptance, "
        "`speculative/calibration.py`); with the n-gram and dspark drafters a request whose drafts have "
        "not been paying does not wait for its last token (dspark: nor runs its block), so decode stays "
        "overlapped, and is probed now and then in case acceptance came back (`gate.py`); "
        '"fixed": verify every proposed draft (up to k), for comparison.')
    verify_cost_per_token: float = Field(
        0.02, gt=0, le=1,
        description="confidence policy: the time one extra verified token adds to a step, relative to the "
        "step's fixed cost (memory-bound decode: small).")
    sync_cost: float = Field(
        0.25, ge=0, le=10,
        description="confidence policy: the time a step that verifies drafts loses, once, to reading its "
        "accepted counts before the next step is planned (a plain decode step overlaps that host work), "
        "relative to the step's fixed cost; drafts are verified only if they pay for it too.")
    acceptance: Literal["seeded", "rejection"] = Field(
        "seeded",
        description='"seeded": accept a draft iff it equals the target\'s own seeded draw there (output '
        "identical to no speculation); \"rejection\": standard rejection sampling (min(1, p/q), residual) "
        "through the VerifyBackend for requests without a seed and without top-k/top-p/min-p or other "
        "logit filters (others use the seeded rule).")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens is {self.num_speculative_tokens}; at most "
                             f"{MAX_SPECULATIVE_TOKENS} are supported")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


def check_against_model(spec: SpeculativeConfig | None, model_type: str, drafters: tuple[str, ...],
                        dspark_block_size: int = 0) -> None:
    """Whether `model_type` (carrying `drafters`, `ModelCapabilities`) can serve `spec`.

    :raises ConfigError: one plain sentence: a model drafter the checkpoint lacks (V4.1's `mtp.*` slot
        holds DSpark, not an MTP layer), or more dspark drafts than its block has slots.
    """
    if spec is None or spec.method not in MODEL_DRAFTERS:
        return
    if spec.method == "mtp" and "dspark" in drafters:
        raise ConfigError(f"speculative_config method 'mtp': the `mtp.*` slot of this {model_type} checkpoint "
                         "holds DSpark, not a multi-token-prediction layer; use method 'dspark'")
    if spec.method not in drafters:
        raise ConfigError(f"speculative_config method {spec.method!r}: {model_type} carries no such drafter "
                         f"(it carries {list(drafters)}; dspark needs a DeepSeek-V4.1 checkpoint with DSpark "
                         "weights: num_nextn_predict_layers and dspark_block_size set); use method 'ngram'")
    if spec.method == "dspark" and spec.num_speculative_tokens > dspark_block_size:
        raise ConfigError(f"num_speculative_tokens is {spec.num_speculative_tokens}, but a DSpark block drafts "
                         f"{dspark_block_size} tokens (dspark_block_size); use num_speculative_tokens <= "
                         f"{dspark_block_size}")
