"""Routed MoE on the Ascend 950 through torch_npu: gating top-k, token permutation, grouped GEMMs.

1. router logits in fp32; `npu_moe_gating_top_k` picks each token's experts (`norm_type` 2 is V4's
   sqrt-softplus; the score bias steers selection only; hash layers pass `input_ids` and `tid2eid`).
   The routing weights are then the picked unbiased scores, normalised and scaled in PyTorch, exactly
   as the contract states (the op's own renormalisation differs by `norm_type` across docs);
2. `npu_moe_init_routing_v2` sorts the `T * top_k` rows by expert (stable) and counts each expert's rows;
3. two `npu_grouped_matmul` calls (one output tensor, `group_list_type=1`: counts), with V4's SwiGLU
   clamp between them in PyTorch (vllm-ascend computes it in torch on A5 too);
4. the combine gathers each `(token, k)` row back through `expanded_row_idx` and sums with the weights.

No value is read back to the host; shapes depend on the token count only (graph-safe).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from deepinfer_ascend950.constraints import NORM_TYPES, check_moe_spec
from deepinfer_core.backends.moe import MoESpec, MoEWeights
from deepinfer_core.reference.moe import SCORING, swiglu

SPLIT_SINGLE_OUTPUT = 3
"""`split_item`: x and the output are single tensors split by `group_list` (2 and 3 both mean so)."""
GROUP_COUNTS = 1
"""`group_list_type`: `group_list` holds each expert's row count (0 would be a cumulative sum)."""


def routing_weights(logits: torch.Tensor, ids: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """`[T, top_k]` fp32: the picked unbiased scores normalised to sum 1, times `routed_scaling_factor`."""
    picked = SCORING[spec.scoring_func](logits).gather(1, ids.long())
    return picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) * spec.routed_scaling_factor


def combine(expert_out: torch.Tensor, expanded_row_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[T, H]` fp32 `sum_k weights[t, k] * expert_out[expanded_row_idx[t * top_k + k]]`."""
    num_tokens, top_k = weights.shape
    rows = expert_out[expanded_row_idx.long()].float().view(num_tokens, top_k, -1)
    return (rows * weights[..., None]).sum(dim=1)


class AscendMoE:
    """`MoEBackend` on the Ascend 950 (BF16/FP16 experts)."""

    supports_cuda_graphs = True
    """Every op is sized from the token count; no value is read back."""

    def __init__(self, spec: MoESpec, device: torch.device, torch_npu: ModuleType) -> None:
        check_moe_spec(spec.num_experts, spec.top_k, spec.scoring_func, spec.is_hash, spec.dtype)
        self.spec, self.device, self.npu = spec, device, torch_npu
        self._int32_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """`id(tid2eid)` -> (the layer's table, its int32 copy): converted once per hash layer."""

    def _tid2eid(self, table: torch.Tensor) -> torch.Tensor:
        if table.dtype == torch.int32:
            return table
        cached = self._int32_tables.get(id(table))
        if cached is None or cached[0] is not table:
            cached = self._int32_tables[id(table)] = (table, table.to(torch.int32))
        return cached[1]

    def route(self, x: torch.Tensor, input_ids: torch.Tensor, weights: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T, top_k]` int32 expert ids and fp32 routing weights."""
        spec = self.spec
        logits = F.linear(x, weights.router).float()  # in the model's dtype, as the reference scores
        options = {}
        if spec.is_hash:
            if weights.tid2eid is None:
                raise ValueError("hash MoE layer needs MoEWeights.tid2eid")
            options = {"input_ids": input_ids.long(), "tid2eid": self._tid2eid(weights.tid2eid)}
        elif weights.score_bias is not None:
            options = {"bias": weights.score_bias.float()}
        _, ids, _ = self.npu.npu_moe_gating_top_k(
            logits, spec.top_k, k_group=1, group_count=1, group_select_mode=0, renorm=0,
            norm_type=NORM_TYPES[spec.scoring_func], out_flag=False, routed_scaling_factor=1.0, eps=1e-20, **options)
        return ids, routing_weights(logits, ids, spec)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
        spec = self.spec
        num_tokens = x.shape[0]
        if num_tokens == 0:
            return torch.zeros_like(x)
        ids, routing = self.route(x, input_ids, weights)
        expanded_x, expanded_row_idx, counts, _ = self.npu.npu_moe_init_routing_v2(
            x, ids, active_num=num_tokens * spec.top_k, expert_num=spec.num_experts, drop_pad_mode=0,
            expert_tokens_num_type=GROUP_COUNTS, expert_tokens_num_flag=True, quant_mode=-1,
            active_expert_range=[0, spec.num_experts], row_idx_type=0)
        h = self._grouped(expanded_x, weights.gate_up, counts)
        h = swiglu(h, spec.swiglu_limit).to(x.dtype)
        y = self._grouped(h, weights.down, counts)
        return combine(y, expanded_row_idx, routing).to(x.dtype)

    def _grouped(self, rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`rows @ weight[e].T` for each expert's run of rows; `weight` `[E, N, K]` is passed as the
        transposed view `[E, K, N]` the op multiplies by (no copy)."""
        out = self.npu.npu_grouped_matmul([rows], [weight.transpose(1, 2)], group_list=counts,
                                          split_item=SPLIT_SINGLE_OUTPUT, group_type=0,
                                          group_list_type=GROUP_COUNTS)
        return out[0]
