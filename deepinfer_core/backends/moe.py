"""MoE contract: routing (top-k or hash) plus the routed experts, for one layer's flat tokens.

The shared expert is not part of the backend: the model adds it. A backend may fuse routing, token
permutation, the grouped GEMMs with the SwiGLU clamp and the weighted combine in any way it likes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from deepinfer_core.backends.graphs import GraphCapturable


@dataclass(frozen=True)
class MoESpec:
    """What one MoE layer kind needs; one backend is built per distinct spec."""

    hidden_size: int
    """Token width."""
    intermediate_size: int
    """Per-expert SwiGLU width (`moe_intermediate_size`)."""
    num_experts: int
    """Routed experts (`n_routed_experts`)."""
    top_k: int
    """Experts per token (`num_experts_per_tok`)."""
    scoring_func: str
    """Router activation: `sqrtsoftplus`, `sigmoid` or `softmax`."""
    routed_scaling_factor: float
    """Multiplies the normalised routing weights."""
    swiglu_limit: float
    """Clamp on the gate (max) and up (both sides) pre-activations; 0 disables it."""
    is_hash: bool = False
    """True for `hash_moe` layers: experts come from `tid2eid[token_id]`, not from the scores."""
    dtype: torch.dtype = torch.float32
    """Activation dtype, and the routed experts' weight dtype when `expert_format` is "dense"."""
    expert_format: Literal["dense", "fp4"] = "dense"
    """Routed-expert storage: "dense" (in `dtype`) or "fp4" (packed e2m1 codes with one power-of-two
    scale per 32 inputs, the checkpoint's own bytes; see `MoEWeights` and `deepinfer_core.backends.quant`).
    A backend that cannot read a format declines the spec."""
    deterministic: bool = False
    """Batch-invariant mode (`EngineConfig.deterministic`): a token's output must be bit-identical
    whatever other tokens share the call (fixed-shape GEMMs, experts combined in ascending expert order,
    no atomics). A backend without such a variant declines the spec."""
    expert_parallel: bool = False
    """The routed experts are spread over expert-parallel ranks (`enable_expert_parallel`): the layer's
    `MoEWeights` hold only this rank's physical slots and carry an `ExpertPlacement`; the backend sends
    each token to the ranks of its experts and combines the answers. A backend without a dispatch of its
    own declines such specs."""
    ep_size: int = 1
    """Expert-parallel ranks."""
    ep_rank: int = 0
    """This rank's index among the expert-parallel ranks (its share of the slots: `ep_slot_share`)."""
    num_slots: int = 0
    """Physical expert slots over all EP ranks (`num_experts` plus the redundant ones; 0: `num_experts`),
    split over the ranks by `ep_slot_share` (the first ranks take one more when they do not divide)."""

    @property
    def num_local_slots(self) -> int:
        """Physical expert slots this rank holds (every expert without expert parallelism)."""
        if not self.expert_parallel:
            return self.num_experts
        return ep_slot_share(self.num_slots or self.num_experts, self.ep_size, self.ep_rank)[1]


def ep_slot_share(num_slots: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """`(first slot, slot count)` of EP rank `ep_rank` when `num_slots` physical expert slots are laid
    out rank-major over `ep_size` ranks as vLLM's linear placement does: `num_slots // ep_size` each,
    and the first `num_slots % ep_size` ranks one more (9 slots over 2 ranks: slots 0-4, then 5-8)."""
    base, extra = divmod(num_slots, ep_size)
    return ep_rank * base + min(ep_rank, extra), base + (1 if ep_rank < extra else 0)


@dataclass
class MoEWeights:
    """One layer's routed-expert parameters, as the model holds them (transformers' layout).

    With `MoESpec.expert_format == "fp4"`, `gate_up` and `down` hold packed e2m1 codes (int8, two a
    byte, low nibble = even input column; last dim halved) and `gate_up_scale` / `down_scale` one
    float8_e8m0fnu scale per 32 input columns (last dim `/ 32`); `w = e2m1(code) * scale`
    (`quant.dequantize_fp4`). Shapes below are the logical (dense) ones.
    """

    router: torch.Tensor
    """`[num_experts, hidden_size]` gate weight."""
    gate_up: torch.Tensor
    """`[num_experts, 2 * intermediate_size, hidden_size]`: gate rows then up rows."""
    down: torch.Tensor
    """`[num_experts, hidden_size, intermediate_size]`."""
    score_bias: torch.Tensor | None = None
    """`[num_experts]` fp32 `e_score_correction_bias` (top-k layers), added for selection only."""
    tid2eid: torch.Tensor | None = None
    """`[vocab_size, top_k]` int64 token-to-experts table (hash layers)."""
    gate_up_scale: torch.Tensor | None = None
    """`[num_experts, 2 * intermediate_size, hidden_size / 32]` FP4 group scales (fp4 format only)."""
    down_scale: torch.Tensor | None = None
    """`[num_experts, hidden_size, intermediate_size / 32]` FP4 group scales (fp4 format only)."""
    placement: ExpertPlacement | None = None
    """Where the layer's experts live across expert-parallel ranks (None without expert parallelism);
    then the leading dim of `gate_up`, `down` and their scales is `MoESpec.num_local_slots`, not
    `num_experts`."""


@dataclass
class ExpertPlacement:
    """One MoE layer's routed experts over the expert-parallel ranks: logical experts (what the router
    picks) held in physical slots, rank-major, split by `ep_slot_share` (the first ranks hold one slot
    more when the ranks do not divide the slots). Redundant slots hold replicas of busy experts (EPLB).
    The tensors live on the device and are updated in place when experts move, so captured graphs stay
    valid."""

    group: Any
    """torch.distributed group of the EP ranks (None: a process of its own, no collectives)."""
    rank: int
    """This rank's index in `group`."""
    size: int
    """EP ranks."""
    num_local_slots: int
    """Slots this rank holds (`ep_slot_share(num_slots, size, rank)[1]`)."""
    slot_experts: torch.Tensor
    """`[num_slots]` int64 logical expert held by each physical slot (DeepSeek EPLB's `phy2log`)."""
    expert_slots: torch.Tensor
    """`[num_experts, max_replicas]` int64 physical slots of each logical expert, padded with -1 (`log2phy`)."""
    replica_counts: torch.Tensor
    """`[num_experts]` int64 replicas of each logical expert (`logcnt`)."""
    slot_load: torch.Tensor
    """`[num_slots]` int64 token assignments this rank sent to each physical slot since the load was last
    read; the backend adds to it on the device, with no host sync (EPLB's load window reads it)."""
    time_dispatch: bool = False
    """Measure the dispatch's collectives (synchronising the device around each; benches only)."""
    dispatch_s: float = 0.0
    """Seconds spent in this layer's dispatch collectives while `time_dispatch` was on."""
    first_slot: int = field(init=False, default=0)
    """This rank's first physical slot (`ep_slot_share`)."""

    def __post_init__(self) -> None:
        first, count = ep_slot_share(self.num_slots, self.size, self.rank)
        if count != self.num_local_slots:
            raise ValueError(f"EP rank {self.rank} of {self.size} holds {count} of the {self.num_slots} expert "
                             f"slots, not {self.num_local_slots}")
        self.first_slot = first

    @property
    def num_slots(self) -> int:
        return self.slot_experts.numel()

    def slot_owners(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(EP rank, index among that rank's slots)` of every physical slot id in `slots`, on the device."""
        base, extra = divmod(self.num_slots, self.size)
        wide = (base + 1) * extra  # the slots of the first `extra` ranks, which hold one more each
        ranks = torch.where(slots < wide, slots // (base + 1), extra + (slots - wide) // max(base, 1))
        return ranks, slots - ranks * base - ranks.clamp(max=extra)

    def local_experts(self) -> list[int]:
        """Logical expert of each of this rank's slots, in slot order."""
        return self.slot_experts[self.first_slot : self.first_slot + self.num_local_slots].tolist()


EXPERT_FORMATS = ("dense", "fp4")
"""Every `MoESpec.expert_format`."""


@runtime_checkable
class MoEBackend(GraphCapturable, Protocol):
    """Routes flat tokens to experts and returns the weighted sum of their outputs.

    A backend that reads other expert formats than "dense" says so with an `expert_formats` attribute
    (a tuple of `EXPERT_FORMATS`); one without it reads dense experts only (`check_expert_format`)."""

    spec: MoESpec

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
        """Route and run the routed experts.

        Routing: `scores = scoring_func(x @ router.T)`; top-k layers pick the `top_k` largest
        `scores + score_bias`, hash layers take `tid2eid[input_ids]`; the picked scores are normalised
        to sum 1 and multiplied by `routed_scaling_factor`. Expert `e` computes
        `down_e(silu(min(g, limit)) * clamp(u, -limit, limit))` with `g, u` from `gate_up_e @ x`.

        :param x: `[num_tokens, hidden_size]` normalised layer input.
        :param input_ids: `[num_tokens]` token ids (used by hash layers only).
        :param weights: the layer's `MoEWeights`.
        :returns: `[num_tokens, hidden_size]` in `x`'s dtype.
        """
        ...


def check_expert_format(backend: object, spec: MoESpec) -> None:
    """Raise unless `backend` (built for `spec`) declares it reads `spec.expert_format` experts.

    Guards against a plugin that predates a format and returned a backend for a spec it would misread.

    :raises ValueError: naming the backend, the format and the option that dequantises at load instead.
    """
    formats = getattr(backend, "expert_formats", ("dense",))
    if spec.expert_format not in formats:
        raise ValueError(
            f"{type(backend).__qualname__} was built for {spec.expert_format!r} experts but reads only "
            f"{list(formats)}; its plugin should decline such specs. Load with "
            f"quantized_weights='dequantize' to run it on dequantised experts"
        )


def check_expert_parallel(backend: object, spec: MoESpec) -> None:
    """Raise unless `backend` (built for `spec`) declares `supports_expert_parallel` when `spec` is
    expert-parallel: a backend that ignored `MoEWeights.placement` would run local slots as if they
    were every expert.

    :raises ValueError: naming the backend.
    """
    if spec.expert_parallel and not getattr(backend, "supports_expert_parallel", False):
        raise ValueError(
            f"{type(backend).__qualname__} was built for an expert-parallel MoE spec but does not declare "
            f"supports_expert_parallel; its plugin should decline specs with expert_parallel=True"
        )
