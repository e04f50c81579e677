"""Batch-invariant routed MoE (deterministic mode): routing in fixed row tiles, each expert's tokens in
fixed row tiles, and a token's experts summed in ascending expert order without atomics."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backends import MoESpec, MoEWeights
from deepinfer_core.reference.invariant import tile_rows
from deepinfer_core.reference.moe import expert_tensors, route, swiglu


class InvariantMoE:
    """`MoEBackend` for `MoESpec.deterministic`; pure PyTorch, any device (kernels chosen by shape)."""

    supports_cuda_graphs = False  # the experts a step uses are read on the host
    expert_formats = ("dense", "fp4")

    def __init__(self, spec: MoESpec, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self._fp4 = spec.expert_format == "fp4"

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        ids, routing = tile_rows(lambda xt, it: route(xt, it, weights, self.spec), x, input_ids)
        order = ids.argsort(dim=1, stable=True)  # each token's experts in ascending id: the combine order
        ids, routing = ids.gather(1, order), routing.gather(1, order)
        outputs = torch.zeros(*ids.shape, x.shape[1], dtype=x.dtype, device=x.device)
        for expert in torch.unique(ids).tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            gate_up, down = expert_tensors(weights, expert, x.dtype, self._fp4)

            def run(rows, gate_up=gate_up, down=down):
                return F.linear(swiglu(F.linear(rows, gate_up), self.spec.swiglu_limit), down)

            y = tile_rows(run, x[tokens])
            outputs[tokens, slots] = y * routing[tokens, slots, None].to(y.dtype)
        out = outputs[:, 0]
        for slot in range(1, ids.shape[1]):
            out = out + outputs[:, slot]
        return out
