"""DeepSeek-V4.1's layer plan: each layer's compress ratio, its role and the layers it reads from.

Roles (research-v41.md §3, DeepSeek's `inference/model.py`):
- `window`: ratio 0, sliding-window attention only.
- `full`: a KV source; owns the compressor, the index keys (from the compressor latent) and an indexer.
- `reindex`: an index source that is not a KV source; its own indexer query over the KV source's keys
  (restricted to the candidate source's blocks when it comes after it).
- `reuse`: attends the KV source's compressed entries at the latest index source's picks, unchanged.
A compressed layer reads compressed KV from `S(L) = max{s in kv_sources, s <= L}` and picks from
`R(L) = max{r in index_sources, r <= L}`. Every compressed layer uses the compressed rope (YaRN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.backends import AttentionSpec, MoESpec
from deepinfer_core.models.deepseek_v41.compressor import TAIL_RING_ROWS
from deepinfer_core.models.layer_plan import LayerPlan

ROLES = ("window", "full", "reindex", "reuse")


@dataclass(frozen=True)
class V41LayerPlan(LayerPlan):
    """A V4.1 layer: `LayerPlan` plus its role, index source and the two-level indexer's part."""

    role: str = "window"
    """One of `ROLES`."""
    index_source: int | None = None
    """Layer whose top-k picks this layer attends (itself for `full` / `reindex`); None for `window`."""
    is_candidate_source: bool = False
    """This layer's indexer also picks the candidate blocks later index sources select within."""
    uses_candidates: bool = False
    """This layer's indexer scores only inside the candidate source's blocks."""
    has_engram: bool = False
    """Engram runs on the streams before this layer's attention."""
    holds_token_ids: bool = False
    """This layer's cache holds the paged per-position compressed token ids Engram looks back at."""

    @property
    def ratio(self) -> int:
        return self.compress_rate

    @property
    def has_indexer(self) -> bool:
        """Owns index keys (a KV source): what the cache reads."""
        return self.role == "full"

    @property
    def runs_indexer(self) -> bool:
        """Computes its own top-k (`full` and `reindex`)."""
        return self.role in ("full", "reindex")

    @property
    def tail_rows(self) -> int:
        """The tail ring's rows (`compressor.TAIL_RING_ROWS`): ratio 2's open group needs one, the ring keeps
        enough that a verification step's k + 1 positions never share a row, so rejected drafts roll back
        exactly (`speculative/rollback.py`); ratio 1 never has an open group."""
        return max(self.compress_rate, TAIL_RING_ROWS) if self.compress_rate > 1 else 0

    @property
    def tail_width(self) -> int:
        return self.attention.head_dim

    @property
    def index_tail_width(self) -> int:
        return 0

    @property
    def fp32_tails(self) -> bool:
        """The open group's rows stay float32, as the reference pools them."""
        return True

    @property
    def owns_token_ids(self) -> bool:
        return self.holds_token_ids


def latest(sources: list[int], layer: int) -> int:
    """`max{s in sources : s <= layer}`."""
    return max(s for s in sources if s <= layer)


def build_v41_plan(config, dtype: torch.dtype) -> list[V41LayerPlan]:
    """One `V41LayerPlan` per decoder layer of `config` (a `V41Config`; DSpark stages not included)."""
    plans = []
    kv, index, candidate = config.kv_source_layer_ids, config.index_source_layer_ids, config.candidate_source_layer_id
    moe = MoESpec(hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
                  num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                  scoring_func=config.scoring_func, routed_scaling_factor=float(config.routed_scaling_factor),
                  swiglu_limit=float(config.swiglu_limit), is_hash=False, dtype=dtype)
    for layer in range(config.num_hidden_layers):
        ratio = config.compress_ratios[layer]
        sparse = ratio > 0
        attention = AttentionSpec(
            num_heads=config.num_attention_heads, head_dim=config.head_dim, sliding_window=config.sliding_window,
            compress_rate=ratio, index_n_heads=config.index_n_heads if sparse else 0,
            index_head_dim=config.index_head_dim if sparse else 0, index_topk=config.index_topk if sparse else 0,
            dtype=dtype,
        )
        engram = config.engram_layer_ids
        common = {"index": layer, "attention": attention, "moe": moe, "has_engram": layer in engram,
                  "holds_token_ids": bool(engram) and layer == engram[0]}
        if not sparse:
            plans.append(V41LayerPlan(kind="sliding", rope="main", role="window", **common))
            continue
        role = "full" if layer in kv else "reindex" if layer in index else "reuse"
        plans.append(V41LayerPlan(
            kind="compressed", rope="compress", role=role, **common,
            kv_source=None if role == "full" else latest(kv, layer),
            index_source=latest(index, layer),
            is_candidate_source=layer == candidate,
            uses_candidates=role != "reuse" and 0 <= candidate < layer,
        ))
    return plans
