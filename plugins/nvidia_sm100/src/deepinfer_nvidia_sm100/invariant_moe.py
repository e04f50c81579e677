"""Batch-invariant routed MoE on NVIDIA GPUs (`MoESpec.deterministic`): `TritonMoE` with every choice that
depends on the token count fixed.

- Router logits: fixed `ROW_TILE`-row GEMM tiles (`deepinfer_core.reference.invariant.tile_rows`), so cuBLAS
  runs one shape whatever the batch; the routing kernel is one program a token already.
- Experts: one tile configuration for every step (`invariant_config`: the default's decode tiles, FP4's
  kernels included: with bf16 activations the MMA with the weights as first operand, where each token's
  column is its own product), no split-K: each program reduces its rows over the whole hidden (then
  intermediate) dim in `block_k` steps, so a row's products do not depend on how many rows its expert
  has, nor where in a block it lands.
- Combine: a token's `top_k` weighted rows are added one after another in slot order (the router's pick
  order, a function of the token's own scores), fp32, no atomics.

Decode steps at default batch sizes pick the same tiles in default mode, so they cost about the same;
prefill runs 16-row blocks instead of 64 or 128 (measured by `bench/gpu_decode.py --deterministic`).
"""

from __future__ import annotations

import torch

from deepinfer_core.backends.moe import MoESpec, MoEWeights
from deepinfer_core.reference.invariant import tile_rows
from deepinfer_nvidia_sm100.moe import GemmConfig, TritonMoE, pick_config


def invariant_config(spec: MoESpec) -> GemmConfig:
    """The grouped GEMMs' tiles for every step of deterministic mode (gate_up and down alike): the ones
    default mode picks for decode (few rows an expert; FP4 experts: the weights-first MMA with bf16
    activations, the CUDA-core products with fp32 ones, both computing each row on its own)."""
    element_size = torch.empty(0, dtype=spec.dtype).element_size()
    return pick_config(0, spec.num_experts, element_size, fp4=spec.expert_format == "fp4")


class InvariantTritonMoE(TritonMoE):
    """`MoEBackend` for deterministic specs on CUDA devices of compute capability >= 9.0."""

    supports_cuda_graphs = True
    """Launch sizes come from the token count alone, as in `TritonMoE`."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__(spec)
        self.config = invariant_config(spec)

    def router_logits(self, x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
        logits = super().router_logits
        return tile_rows(lambda rows: logits(rows, weights), x)

    @staticmethod
    def sum_slots(rows: torch.Tensor) -> torch.Tensor:
        out = rows[:, 0]
        for slot in range(1, rows.shape[1]):
            out = out + rows[:, slot]
        return out

    def experts(self, x, ids, topk_weights, weights, config=None, down_config=None) -> torch.Tensor:
        """`TritonMoE.experts` with `self.config` (a caller's tiles would break the invariance)."""
        if config is not None or down_config is not None:
            raise ValueError("InvariantTritonMoE runs its one tile configuration only; pass none")
        return super().experts(x, ids, topk_weights, weights, self.config, self.config)
