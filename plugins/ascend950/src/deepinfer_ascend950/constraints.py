"""The documented argument constraints of every NPU op the plugin calls, checked before the call.

A violated constraint raises `AscendConstraintError` naming the op, the argument and the allowed values,
instead of an opaque CANN failure. Spec-level checks (`check_*_spec`) run when a backend is built; the
hooks turn their error into a decline, so the reference serves that spec. Sources: hicann/ops-transformer
`attention/sparse_flash_mla/docs/torchapi_sparse_flash_mla.md`; Ascend/op-plugin's torch_npu API docs
(research-ascend.md §3).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)
MAX_PAGED_BLOCK = 1024


class AscendConstraintError(ValueError):
    """An argument violates the documented constraint of an NPU op."""

    def __init__(self, op: str, argument: str, problem: str) -> None:
        super().__init__(f"{op}: {argument} {problem}")
        self.op, self.argument = op, argument


def require(condition: bool, op: str, argument: str, problem: str) -> None:
    """`AscendConstraintError(op, argument, problem)` unless `condition`."""
    if not condition:
        raise AscendConstraintError(op, argument, problem)


def require_in(value, allowed: Iterable, op: str, argument: str) -> None:
    allowed = tuple(allowed)
    require(value in allowed, op, argument, f"is {value!r}; the op supports {list(allowed)}")


def require_dtype(tensor: torch.Tensor, allowed: Iterable[torch.dtype], op: str, argument: str) -> None:
    allowed = tuple(allowed)
    require(tensor.dtype in allowed, op, argument,
            f"has dtype {tensor.dtype}; the op takes {[str(d).removeprefix('torch.') for d in allowed]}")


# -- sparse_flash_mla (cann_ops_transformer) --------------------------------------------------------

SFM = "cann_ops_transformer.sparse_flash_mla"


def check_sparse_flash_mla_spec(num_heads: int, head_dim: int, sliding_window: int, compress_rate: int,
                                dtype: torch.dtype) -> None:
    """d = 512, one kv head, 1-128 query heads, bf16/fp16, cmp_ratio 1-128, a window of at least 1."""
    require(head_dim == 512, SFM, "head_dim", f"is {head_dim}; only 512 is supported")
    require(1 <= num_heads <= 128, SFM, "num_heads_q", f"is {num_heads}; 950 supports 1 to 128")
    require(dtype in HALF_DTYPES, SFM, "q/ori_kv/cmp_kv dtype", f"is {dtype}; only bfloat16 and float16")
    require(sliding_window >= 1, SFM, "ori_win_left", f"would be {sliding_window - 1}; it must be >= 0")
    require(compress_rate == 0 or 1 < compress_rate <= 128, SFM, "cmp_ratio",
            f"is {compress_rate}; CSA/HCA take 2-128")


def check_sparse_flash_mla_call(q: torch.Tensor, sinks: torch.Tensor, block_size: int,
                                topk_indices: torch.Tensor | None) -> None:
    """Per-call checks on what the step passes (shapes and dtypes only: no device value is read)."""
    require(q.dim() == 3, SFM, "q", f"must be TND [tokens, heads, 512], got {list(q.shape)}")
    require_dtype(q, HALF_DTYPES, SFM, "q")
    require(sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],), SFM, "sinks",
            f"must be float32 [{q.shape[1]}], got {sinks.dtype} {list(sinks.shape)}")
    require(1 <= block_size <= MAX_PAGED_BLOCK, SFM, "block_size", f"is {block_size}; PA_BBND takes 1-1024")
    if topk_indices is not None:
        require(topk_indices.dim() == 2 and topk_indices.shape[0] == q.shape[0] and topk_indices.shape[1] > 0,
                SFM, "cmp_sparse_indices", f"must be [tokens, topk > 0], got {list(topk_indices.shape)}")


# -- torch_npu MoE ops ------------------------------------------------------------------------------

GATING = "torch_npu.npu_moe_gating_top_k"
INIT_ROUTING = "torch_npu.npu_moe_init_routing_v2"
GROUPED_MATMUL = "torch_npu.npu_grouped_matmul"
NORM_TYPES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
"""`norm_type` of `npu_moe_gating_top_k` per scoring function (2 = SqrtSoftplus, CANN's moe_gating_top_k README)."""
MAX_GATING_EXPERTS = 2048
MAX_ROUTING_EXPERTS = 10240
MAX_HASH_TOP_K = 64


def check_moe_spec(num_experts: int, top_k: int, scoring_func: str, is_hash: bool, dtype: torch.dtype) -> None:
    """Routing, permutation and grouped GEMM limits for one MoE layer kind."""
    require_in(scoring_func, NORM_TYPES, GATING, "norm_type (scoring_func)")
    require(num_experts <= MAX_GATING_EXPERTS, GATING, "x", f"has {num_experts} experts; at most {MAX_GATING_EXPERTS}")
    require(1 <= top_k <= num_experts, GATING, "k", f"is {top_k}; 1 to {num_experts} (the expert count)")
    require(not is_hash or top_k <= MAX_HASH_TOP_K, GATING, "tid2eid", f"has k={top_k}; hash mode takes k <= 64")
    require(num_experts <= MAX_ROUTING_EXPERTS, INIT_ROUTING, "expert_num", f"is {num_experts}; at most 10240")
    require(dtype in HALF_DTYPES, GROUPED_MATMUL, "x/weight dtype", f"is {dtype}; the BF16 path takes bf16/fp16")


# -- torch_npu layer ops ----------------------------------------------------------------------------

ROTARY = "torch_npu.npu_rotary_mul"
RMS_NORM = "torch_npu.npu_rms_norm"
MAX_ROTARY_DIM = 896


def check_rotary_call(x: torch.Tensor, cos: torch.Tensor) -> None:
    rope_dim = 2 * cos.shape[-1]
    require(rope_dim < MAX_ROTARY_DIM, ROTARY, "x", f"rotates {rope_dim} channels; D < 896")
    require(x.shape[-1] >= rope_dim, ROTARY, "x", f"has {x.shape[-1]} channels, fewer than the {rope_dim} to rotate")
    require(cos.shape[0] == x.shape[0], ROTARY, "r1", f"has {cos.shape[0]} rows for {x.shape[0]} tokens")
