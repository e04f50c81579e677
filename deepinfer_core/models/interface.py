"""What the engine, the cache and the graphs know of a model: this interface and its layer plan.

A model class (found through `deepinfer_core.models.registry`) is built on the meta device as
`cls(config, plans, dtype, parallel=groups)` from `cls.layer_plan(config, dtype)` (`groups`: the rank's
`deepinfer_core.backends.parallel.ParallelGroups`), loaded with `load_state_dict`, bound
to its backends once, and then run one step at a time on a `ForwardContext` and the cache's
`LayerCache`s. Nothing else of it is read outside `deepinfer_core/models/`: what `CausalLM`
declares is the whole contract.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from deepinfer_core.backends import AttentionBackend, AttentionMetadata, LayerOps, MoEBackend, MoEWeights
from deepinfer_core.backends.parallel import ParallelGroups
from deepinfer_core.config import ModelCapabilities
from deepinfer_core.models.layer_plan import BLOCK_SIZE, LayerPlan


@dataclass
class LayerCache:
    """One layer's cache tensors (see `deepinfer_core.kv.cache`); None where the layer has none."""

    window: torch.Tensor
    compressed: torch.Tensor | None = None
    kv_tail: torch.Tensor | None = None
    gate_tail: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    index_kv_tail: torch.Tensor | None = None
    index_gate_tail: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    """Paged per-position ids (`LayerPlan.owns_token_ids`), read back by look-back models."""


@dataclass
class ForwardContext:
    """Per-step inputs every layer reads; built once per step by the runner (`ModelRunner.make_context`)."""

    metadata: AttentionMetadata
    input_ids: torch.Tensor
    rope: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """Per rope kind, cos, sin and -sin (the inverse rotation) for every token."""
    num_entries: dict[int, torch.Tensor]
    """Per compress rate, `[num_seqs]` entries each request has after this step."""
    no_write_before: torch.Tensor
    """`[num_seqs]` int64: per request, entries of windows ending at or before this position are
    already cached and must not be rewritten."""
    parallel: ParallelGroups | None = None
    """This rank's parallel groups (`deepinfer_core.backends.parallel`); None: a world of one rank."""
    keep_from: list[int] | None = None
    """Decoder-side trimming (DeepSeek-V4.1, `models/v41_trim.py`): per request, the first position that
    runs the layers after the model's trim point; None: every row runs every layer."""
    replay_hits: list[int] | None = None
    """Exact SWA replay (V4, `row_trim.replay_keep_from`): per request, the prefix-cache hit its replay
    rebuilds the windows up to (0: none); layer `l` then runs only the rows it needs. None: no request of
    the step replays below a hit (or the model runs every row)."""


@runtime_checkable
class CausalLM(Protocol):
    """The model side of a step: everything the engine, the runner, the graphs and the drafters read of a
    model. A class is constructed as `cls(config, plans, dtype, parallel=groups)` (`groups`: the rank's
    `ParallelGroups`) from `cls.layer_plan(config, dtype)`, and also provides, as class-level functions:

    - `layer_plan(config, dtype) -> list[LayerPlan]` (a classmethod);
    - `host_weight_names(names, engram_placement) -> set[str]` (a staticmethod): the weights loaded straight
      into host memory, never onto the device;
    - `load_checkpoint(model_dir, config, dtype, device, keep_fp4=False, host=(), digest=None, keep_fp8=())`
      (a classmethod), only where `capabilities.has_checkpoint_loader`: the weights of its own checkpoint
      layout, in its names, every byte read given to `digest` (a `loading.weight_digest.WeightDigest`, the
      cache fingerprint's); the FP8 projections named in `keep_fp8` kept FP8 with a `<name>_scale` beside
      them, as `loading.weights.load_weights(..., keep_fp8=...)` returns them.
    """

    capabilities: ModelCapabilities
    """What the family can do (its config's `capabilities`): parallelism, replay default, drafters, Engram,
    trimming, its own loader. The engine asks this, never the class or `model_type`."""
    plans: list[LayerPlan]
    ops: LayerOps | None
    """The bound layer ops (`bind_backends`); drafters bound to the model share them."""
    moe_weights: list[MoEWeights]
    """Per layer, the routed experts' weights its MoE backend runs (bound; expert parallelism moves them)."""
    trim_layer: int | None
    """Decoder-side trimming's start layer, set by the runner where `capabilities.can_trim_decoder`; None: off."""
    keeps_final_streams: bool
    """Keep every token's last residual streams in `final_streams` (set where a drafter reads them)."""
    final_streams: torch.Tensor | None
    """The last step's residual streams when `keeps_final_streams` (the MTP drafter's input), else None."""

    def bind_backends(self, attention: list[AttentionBackend], moe: list[MoEBackend], ops: LayerOps,
                      device: torch.device) -> None:
        """Attach one attention and one MoE backend per layer and the layer ops, after loading. A model with
        Engram tables (`capabilities.has_engram`) reads `engram_placement` and `engram_prefetch`, set on it
        before this call."""

    def backends(self) -> list[object]:
        """Every bound backend object (graph capture needs each to support CUDA graphs)."""

    def rope_tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per rope kind, cos, sin and -sin of `positions`, once a step for every layer."""

    def forward(self, ctx: ForwardContext, caches: list[LayerCache], logits_indices: torch.Tensor) -> torch.Tensor:
        """Run every layer over the step's tokens; fp32 logits `[len(logits_indices), vocab]`."""

    def forward_idle(self) -> None:
        """A step without tokens: every MoE backend runs on no rows, so an idle data-parallel rank joins
        the other ranks' expert-parallel collectives."""

    def close(self) -> None:
        """Stop whatever the model runs beside the steps (V4.1's Engram prefetch worker); at shutdown."""


@runtime_checkable
class SplitStepExchange(Protocol):
    """Layer ops under context parallelism (`distributed.context_parallel_ops.ContextParallelLayerOps`), for
    a model that closes compressed entries or writes paged rows itself (V4.1) rather than through
    `LayerOps.compress`. On a split step (a rank runs only its pieces of the step's tokens) each method
    exchanges with the other ranks of the cp group; on every other step `split_tail_rings` returns None,
    `share_entries` does nothing and `share_rows` writes this rank's rows only."""

    def split_tail_rings(self, metadata: AttentionMetadata, kv: torch.Tensor, gate: torch.Tensor,
                         kv_tail: torch.Tensor, gate_tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per piece, scratch tail rings holding the `(kv, gate)` rows just before it (other ranks' rows,
        or the request's rings for positions before the step); the real rings get each request's last
        rows of the step, identically on every rank. None on a step that is not split."""

    def share_entries(self, metadata: AttentionMetadata, pools: list[torch.Tensor], rate: int) -> None:
        """Every rank's pools receive the entries (rate `rate`) every other rank's pieces closed."""

    def share_rows(self, metadata: AttentionMetadata, pool: torch.Tensor, rows: torch.Tensor,
                   values: torch.Tensor) -> None:
        """`pool[rows] = values`, with every rank's rows and values of the step."""


def cache_fingerprint(config, dtype: torch.dtype, plans: list[LayerPlan], weights_identity: bytes) -> bytes:
    """What cached blocks depend on besides their tokens: the model's config, its weights (`weights_identity`:
    `loading.weight_digest`'s hash of every byte the ranks read), the compute dtype and the cache layout.
    The root of every block key chain (`BlockManager`), so also of the host tier's, the store's and
    prefill/decode transfers' keys."""
    layout = {"config": config.model_dump(mode="json"), "dtype": str(dtype), "block_size": BLOCK_SIZE,
              "plans": [repr(plan) for plan in plans]}
    return hashlib.sha256(json.dumps(layout, sort_keys=True, default=str).encode() + weights_identity).digest()
