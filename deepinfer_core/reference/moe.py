"""Reference routed MoE: V4 routing, then a loop over the experts that received tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backends import MoESpec, MoEWeights

GATHER_LIMIT = 2**25
"""Largest number of expert-weight elements the gathered path may copy in one step."""

SCORING = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: logits.softmax(dim=-1),
}


def route(x: torch.Tensor, input_ids: torch.Tensor, weights: MoEWeights, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids `[T, top_k]` and their routing weights `[T, top_k]` (normalised, scaled)."""
    scores = SCORING[spec.scoring_func](F.linear(x, weights.router))
    if spec.is_hash:
        ids = weights.tid2eid[input_ids].long()
    else:
        biased = scores + weights.score_bias if weights.score_bias is not None else scores
        ids = torch.topk(biased, spec.top_k, dim=-1, sorted=False).indices
    picked = scores.gather(1, ids)
    picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, picked * spec.routed_scaling_factor


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


class ReferenceMoE:
    """Pure-PyTorch `MoEBackend`."""

    supports_cuda_graphs = False  # the grouped path sizes expert batches from bincount(...).tolist()

    def __init__(self, spec: MoESpec, device: torch.device) -> None:
        self.spec, self.device = spec, device

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
        ids, routing = route(x, input_ids, weights, self.spec)
        spec = self.spec
        if ids.numel() * 3 * spec.intermediate_size * spec.hidden_size <= GATHER_LIMIT:
            return self._gathered(x, ids, routing, weights)
        return self._per_expert(x, ids, routing, weights)

    def _gathered(self, x, ids, routing, weights: MoEWeights) -> torch.Tensor:
        """Few tokens (decode): gather each assignment's expert weights and run one batched matmul."""
        flat = ids.flatten()
        h = torch.bmm(weights.gate_up[flat], x.repeat_interleave(ids.shape[1], dim=0)[:, :, None])
        h = swiglu(h.squeeze(-1), self.spec.swiglu_limit)
        y = torch.bmm(weights.down[flat], h[:, :, None]).squeeze(-1).view(*ids.shape, -1)
        return (y * routing[..., None].to(y.dtype)).sum(dim=1).to(x.dtype)

    def _per_expert(self, x, ids, routing, weights: MoEWeights) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.spec.num_experts).tolist()
        token_of = order // ids.shape[1]
        scale = routing.flatten()[order]
        offset = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[offset : offset + count]
            h = swiglu(F.linear(x[tokens], weights.gate_up[expert]), self.spec.swiglu_limit)
            y = F.linear(h, weights.down[expert]) * scale[offset : offset + count, None].to(x.dtype)
            out.index_add_(0, tokens, y.to(out.dtype))
            offset += count
        return out
