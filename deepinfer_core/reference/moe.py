"""Reference routed MoE: V4 routing, then a loop over the experts that received tokens.

FP4 experts (`MoESpec.expert_format == "fp4"`) are dequantised per call, only the experts a step uses,
to the activation dtype: the same values the dequantise-at-load path holds, so both give equal results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backends import MoESpec, MoEWeights, quant
from deepinfer_core.reference.moe_dispatch import expert_parallel_forward

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


def expert_tensors(weights: MoEWeights, experts, dtype: torch.dtype, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(gate_up, down)` of `experts` (an index or an index tensor) as dense `dtype` tensors."""
    if not fp4:
        return weights.gate_up[experts], weights.down[experts]
    if weights.gate_up_scale is None or weights.down_scale is None:
        raise ValueError("FP4 experts need MoEWeights.gate_up_scale and down_scale")
    gate_up = quant.dequantize_fp4(weights.gate_up[experts], weights.gate_up_scale[experts])
    down = quant.dequantize_fp4(weights.down[experts], weights.down_scale[experts])
    return gate_up.to(dtype), down.to(dtype)


class ReferenceMoE:
    """Pure-PyTorch `MoEBackend`."""

    supports_cuda_graphs = False  # the grouped path sizes expert batches from bincount(...).tolist()
    expert_formats = ("dense", "fp4")
    supports_expert_parallel = True  # `moe_dispatch`: all-to-all over the placement's EP group

    def __init__(self, spec: MoESpec, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self._fp4 = spec.expert_format == "fp4"

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
        if weights.placement is not None:
            return expert_parallel_forward(x, input_ids, weights, self.spec, route, self.expert_outputs)
        ids, routing = route(x, input_ids, weights, self.spec)
        spec = self.spec
        if ids.numel() * 3 * spec.intermediate_size * spec.hidden_size <= GATHER_LIMIT:
            return self._gathered(x, ids, routing, weights)
        return self._per_expert(x, ids, routing, weights)

    def _gathered(self, x, ids, routing, weights: MoEWeights) -> torch.Tensor:
        """Few tokens (decode): gather each assignment's expert weights and run one batched matmul."""
        gate_up, down = expert_tensors(weights, ids.flatten(), x.dtype, self._fp4)
        h = torch.bmm(gate_up, x.repeat_interleave(ids.shape[1], dim=0)[:, :, None])
        h = swiglu(h.squeeze(-1), self.spec.swiglu_limit)
        y = torch.bmm(down, h[:, :, None]).squeeze(-1).view(*ids.shape, self.spec.hidden_size)
        return (y * routing[..., None].to(y.dtype)).sum(dim=1).to(x.dtype)

    def expert_outputs(self, rows: torch.Tensor, slots: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
        """Unweighted outputs `[M, H]` of `rows` `[M, H]` through the local expert slots `slots` `[M]`
        (expert parallelism). Few rows: one batched matmul, the same arithmetic as `_gathered`, so a
        token's output does not depend on where its expert ran; many: one matmul per slot."""
        spec = self.spec
        if rows.shape[0] * 3 * spec.intermediate_size * spec.hidden_size <= GATHER_LIMIT:
            gate_up, down = expert_tensors(weights, slots, rows.dtype, self._fp4)
            h = swiglu(torch.bmm(gate_up, rows[:, :, None]).squeeze(-1), spec.swiglu_limit)
            return torch.bmm(down, h[:, :, None]).squeeze(-1)
        out = torch.empty_like(rows)
        for slot in slots.unique().tolist():
            picked = (slots == slot).nonzero().squeeze(1)
            gate_up, down = expert_tensors(weights, slot, rows.dtype, self._fp4)
            out[picked] = F.linear(swiglu(F.linear(rows[picked], gate_up), spec.swiglu_limit), down)
        return out

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
            gate_up, down = expert_tensors(weights, expert, x.dtype, self._fp4)
            h = swiglu(F.linear(x[tokens], gate_up), self.spec.swiglu_limit)
            y = F.linear(h, down) * scale[offset : offset + count, None].to(x.dtype)
            out.index_add_(0, tokens, y.to(out.dtype))
            offset += count
        return out
