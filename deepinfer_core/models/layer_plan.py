"""The declarative per-layer plan, built once from the config. Caches, backends and the runner read it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deepinfer_core.backends import AttentionSpec, LayerOpsSpec, MoESpec
from deepinfer_core.backends.attention import BLOCK_SIZE

__all__ = ["BLOCK_SIZE", "LayerPlan", "build_layer_plan", "deterministic_plans", "layer_ops_spec"]

ATTENTION_KINDS = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


@dataclass(frozen=True)
class LayerPlan:
    """Everything that differs between layers, decided once."""

    index: int
    kind: str
    """`sliding`, `csa` or `hca`."""
    rope: str
    """`main` (sliding layers) or `compress` (CSA/HCA layers, YaRN)."""
    attention: AttentionSpec
    moe: MoESpec
    kv_source: int | None = None
    """Layer whose compressed entries (and indexer keys) this layer reads instead of owning any; None:
    it owns its own (every V4 layer). A reading layer has no compressor and no tails of its own."""

    @property
    def owns_compressed(self) -> bool:
        """The layer writes a compressed pool of its own (it has a compressor and is nobody's reader)."""
        return self.has_compressor and self.kv_source is None

    @property
    def compress_rate(self) -> int:
        return self.attention.compress_rate

    @property
    def has_compressor(self) -> bool:
        return self.kind != "sliding"

    @property
    def has_indexer(self) -> bool:
        return self.kind == "csa"

    @property
    def tail_rows(self) -> int:
        """Compressor tail ring length: CSA keeps the previous window too (overlap)."""
        return 2 * self.compress_rate if self.kind == "csa" else self.compress_rate

    @property
    def tail_width(self) -> int:
        """Width of a compressor tail row: CSA projects both overlap halves."""
        return self.attention.head_dim * (2 if self.has_indexer else 1)

    @property
    def fp32_tails(self) -> bool:
        """Compressor kv tails held in float32 (else the cache dtype; gate tails are always float32)."""
        return False

    @property
    def owns_token_ids(self) -> bool:
        """The layer's cache holds a paged pool of every position's (model-defined) token id, for models
        that look back at earlier tokens (DeepSeek-V4.1's Engram); prefix hits share it like the
        compressed entries."""
        return False

    @property
    def index_tail_width(self) -> int:
        """Width of an indexer-compressor tail row; 0: the layer has no indexer tails."""
        return 2 * self.attention.index_head_dim if self.has_indexer else 0


def build_layer_plan(config, dtype: torch.dtype) -> list[LayerPlan]:
    """One `LayerPlan` per decoder layer of `config` (a `ModelConfig`)."""
    plans = []
    for i, layer_type in enumerate(config.layer_types):
        kind = ATTENTION_KINDS[layer_type]
        rate = 0 if kind == "sliding" else int(config.compress_rates[layer_type])
        if rate and BLOCK_SIZE % rate:
            raise NotImplementedError(
                f"a compress rate not dividing the cache block: compress rate {rate} of {layer_type}; the paged "
                f"cache needs rates dividing its {BLOCK_SIZE}-token block"
            )
        is_csa = kind == "csa"
        attention = AttentionSpec(
            num_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            sliding_window=config.sliding_window,
            compress_rate=rate,
            index_n_heads=config.index_n_heads if is_csa else 0,
            index_head_dim=config.index_head_dim if is_csa else 0,
            index_topk=config.index_topk if is_csa else 0,
            dtype=dtype,
        )
        moe = MoESpec(
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            scoring_func=config.scoring_func,
            routed_scaling_factor=float(config.routed_scaling_factor),
            swiglu_limit=float(config.swiglu_limit or 0.0),
            is_hash=config.mlp_layer_types[i] == "hash_moe",
            dtype=dtype,
        )
        plans.append(LayerPlan(i, kind, "main" if kind == "sliding" else "compress", attention, moe))
    return plans


def layer_ops_spec(config, dtype: torch.dtype, deterministic: bool = False) -> LayerOpsSpec:
    """The model-wide `LayerOpsSpec` (mHC, norms, rope, compressors) for `config`."""
    return LayerOpsSpec(hidden_size=config.hidden_size, hc_mult=config.hc_mult,
                        hc_sinkhorn_iters=config.hc_sinkhorn_iters, hc_eps=config.hc_eps,
                        rms_norm_eps=config.rms_norm_eps, dtype=dtype, deterministic=deterministic)


def deterministic_plans(plans: list[LayerPlan], deterministic: bool) -> list[LayerPlan]:
    """`plans` with every attention and MoE spec asking for its batch-invariant variant (when
    `deterministic`), so the factory hooks build those (`EngineConfig.deterministic`)."""
    if not deterministic:
        return plans
    return [replace(plan, attention=replace(plan.attention, deterministic=True),
                    moe=replace(plan.moe, deterministic=True)) for plan in plans]


def with_expert_format(plans: list[LayerPlan], fmt: str) -> list[LayerPlan]:
    """`plans` with every layer's `MoESpec.expert_format` set to `fmt`."""
    if fmt == "dense":
        return plans
    return [replace(plan, moe=replace(plan.moe, expert_format=fmt)) for plan in plans]
