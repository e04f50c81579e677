"""Test doubles of the NPU ops the plugin calls: pure PyTorch on the CPU, written from the ops' docs.

They exist only in these tests (never installed, never imported by the plugin) and prove the plugin's
plumbing -- argument building, layouts, block tables, index padding, routing index math, dtypes, the
constraint checks -- not the chip: a test passing on them says the plugin calls each op the way its
documentation describes, and that the documented semantics give the reference's answer. Each double
checks the documented argument constraints it can and raises `DocumentedConstraintError` on a
violation, so a plugin that breaks one fails here. Sources: hicann/ops-transformer
`attention/sparse_flash_mla/docs/torchapi_sparse_flash_mla.md`; Ascend's torch_npu API reference for
`npu_moe_gating_top_k`, `npu_moe_init_routing_v2`, `npu_grouped_matmul`, `npu_rms_norm`,
`npu_rotary_mul` (research-ascend.md §3).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

HALF = (torch.bfloat16, torch.float16)
LAYOUT_CODES = {"BSND": 0, "TND": 1, "PA_BBND": 2}


class DocumentedConstraintError(AssertionError):
    """A call broke a constraint the op's documentation states."""


def need(condition: bool, message: str) -> None:
    if not condition:
        raise DocumentedConstraintError(message)


# -- cann_ops_transformer.sparse_flash_mla ----------------------------------------------------------

_SPLIT_FIELDS = ("num_heads_q", "num_heads_kv", "head_dim", "batch_size", "max_seqlen_q", "max_seqlen_ori_kv",
                 "max_seqlen_cmp_kv", "ori_topk", "cmp_topk", "cmp_ratio", "ori_mask_mode", "cmp_mask_mode",
                 "ori_win_left", "ori_win_right", "layout_q", "layout_kv", "has_ori_kv", "has_cmp_kv")


def sparse_flash_mla_metadata(num_heads_q, num_heads_kv, head_dim, *, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                              cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                              cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, batch_size=0,
                              max_seqlen_q=0, max_seqlen_ori_kv=0, max_seqlen_cmp_kv=0, ori_topk=0, cmp_topk=0,
                              cmp_ratio=1, ori_mask_mode=0, cmp_mask_mode=0, ori_win_left=-1, ori_win_right=-1,
                              layout_q="BSND", layout_kv="BSND", has_ori_kv=True, has_cmp_kv=True):
    """The task split is opaque on the chip; here the 1024 int32 record the split parameters, so the
    main op can check it was given a metadata built from the same ones (the doc requires it)."""
    need(1 <= num_heads_q <= 128 and num_heads_kv == 1 and head_dim == 512, "metadata: heads 1-128, kv 1, d 512")
    need(max_seqlen_q > 0, "metadata: max_seqlen_q must be > 0 for TND")
    values = dict(locals())
    record = [LAYOUT_CODES[values[f]] if f.startswith("layout") else int(values[f]) for f in _SPLIT_FIELDS]
    out = torch.zeros(1024, dtype=torch.int32)
    out[: len(record)] = torch.tensor(record, dtype=torch.int32)
    return out


def _check_table(table, name: str, batch: int) -> None:
    need(table is not None and table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == batch,
         f"{name} must be int32 [b, max_blocks]")
    need(bool((table > 0).all()), f"{name}: values can only be positive integers")


def _paged(kv, table, count: int) -> torch.Tensor:
    block = kv.shape[1]
    rows = torch.arange(count)
    return kv[table[rows // block].long(), rows % block, 0].float()


def _check_call(q, ori_kv, cmp_kv, cmp_sparse_indices, sinks, metadata, cu_seqlens_q, seqused_ori_kv, seqused_cmp_kv,
                cmp_residual_kv, ori_block_table, cmp_block_table, layout_q, layout_kv, cmp_ratio, cmp_mask_mode):
    need(layout_q == "TND" and q.dim() == 3 and q.dtype in HALF and q.shape[2] == 512, "q: TND bf16/fp16, d 512")
    need(layout_kv == "PA_BBND" and ori_kv.dim() == 4 and ori_kv.shape[2:] == (1, 512), "ori_kv: PA_BBND [n, bs, 1, 512]")
    need(ori_kv.dtype == q.dtype and 1 <= ori_kv.shape[1] <= 1024, "ori_kv: q's dtype, block size 1-1024")
    need(cu_seqlens_q is not None and cu_seqlens_q.dtype == torch.int32 and int(cu_seqlens_q[0]) == 0
         and bool((cu_seqlens_q.diff() >= 0).all()) and int(cu_seqlens_q[-1]) == q.shape[0], "cu_seqlens_q")
    batch = len(cu_seqlens_q) - 1
    need(seqused_ori_kv is not None and seqused_ori_kv.dtype == torch.int32 and seqused_ori_kv.shape == (batch,),
         "PA_BBND needs int32 seqused_ori_kv [b]")
    _check_table(ori_block_table, "ori_block_table", batch)
    need(sinks is not None and sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],), "sinks: float32 [q_n]")
    need(metadata is not None and metadata.dtype == torch.int32 and metadata.shape == (1024,), "metadata int32 [1024]")
    if cmp_kv is None:
        need(cmp_ratio == 1 and cmp_mask_mode == 0 and cmp_residual_kv is None and cmp_sparse_indices is None,
             "SWA: cmp_ratio 1, cmp_mask_mode 0, no residual, no indices")
        return batch
    need(cmp_kv.dtype == q.dtype and cmp_kv.dim() == 4 and cmp_kv.shape[2:] == (1, 512), "cmp_kv: PA_BBND, q's dtype")
    _check_table(cmp_block_table, "cmp_block_table", batch)
    need(seqused_cmp_kv is not None and seqused_cmp_kv.dtype == torch.int32, "cmp_block_table needs seqused_cmp_kv")
    need(cmp_mask_mode == 3 and 1 < cmp_ratio <= 128, "CSA/HCA: cmp_mask_mode 3, cmp_ratio 2-128")
    need(cmp_residual_kv is not None and cmp_residual_kv.dtype == torch.int32 and cmp_residual_kv.shape == (batch,)
         and bool(((cmp_residual_kv >= 0) & (cmp_residual_kv < cmp_ratio)).all()), "cmp_residual_kv in [0, ratio)")
    if cmp_sparse_indices is not None:
        need(cmp_sparse_indices.dtype == torch.int32 and cmp_sparse_indices.shape[:2] == (q.shape[0], 1),
             "cmp_sparse_indices: int32 [q_t, 1, k]")
    return batch


def sparse_flash_mla(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                     ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                     cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                     cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, sinks=None, metadata=None,
                     softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=-1,
                     ori_win_right=-1, layout_q="BSND", layout_kv="BSND", topk_value_mode=1, return_softmax_lse=False):
    """Shared-KV attention: each query sees its band of `ori_kv` (bottom-right aligned: the last query
    of batch b sits at `seqused_ori_kv[b] - 1`) and its visible `cmp_kv` entries (`cmp_len * cmp_ratio +
    cmp_residual_kv[b]` is the raw length; entry e is visible to raw position p iff `e < (p + 1) //
    cmp_ratio`; CSA keeps only `cmp_sparse_indices`), with a per-head sink in the softmax."""
    batch = _check_call(q, ori_kv, cmp_kv, cmp_sparse_indices, sinks, metadata, cu_seqlens_q, seqused_ori_kv,
                        seqused_cmp_kv, cmp_residual_kv, ori_block_table, cmp_block_table, layout_q, layout_kv,
                        cmp_ratio, cmp_mask_mode)
    need(ori_sparse_indices is None and topk_value_mode == 1 and ori_mask_mode == 4, "ori: band mask, no indices")
    cmp_topk = 0 if cmp_sparse_indices is None else cmp_sparse_indices.shape[2]
    given = {"num_heads_q": q.shape[1], "head_dim": q.shape[2], "batch_size": batch, "cmp_topk": cmp_topk,
             "cmp_ratio": cmp_ratio, "ori_mask_mode": ori_mask_mode, "cmp_mask_mode": cmp_mask_mode,
             "ori_win_left": ori_win_left, "ori_win_right": ori_win_right, "layout_q": LAYOUT_CODES[layout_q],
             "layout_kv": LAYOUT_CODES[layout_kv], "has_ori_kv": 1, "has_cmp_kv": int(cmp_kv is not None)}
    for name, value in given.items():
        need(int(metadata[_SPLIT_FIELDS.index(name)]) == int(value), f"metadata built with another {name}")
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for b in range(batch):
        a, e = starts[b], starts[b + 1]
        n, s = e - a, int(seqused_ori_kv[b])
        keys = _paged(ori_kv, ori_block_table[b], s)
        idx = torch.arange(s - n, s)[:, None]
        r = torch.arange(s)[None]
        visible = (r <= idx + max(ori_win_right, 0)) & ((r >= idx - ori_win_left) if ori_win_left >= 0 else True)
        if cmp_kv is not None:
            c = int(seqused_cmp_kv[b])
            raw = c * cmp_ratio + int(cmp_residual_kv[b])
            positions = torch.arange(raw - n, raw)[:, None]
            entry_visible = torch.arange(c)[None] < (positions + 1) // cmp_ratio
            if cmp_sparse_indices is not None:
                picked = torch.zeros(n, c + 1, dtype=torch.bool)
                chosen = cmp_sparse_indices[a:e, 0].long()
                need(bool((chosen < c).all()), "cmp_sparse_indices: -1 or a valid cmp entry index")
                picked.scatter_(1, torch.where(chosen >= 0, chosen, c).clamp(max=c), True)
                entry_visible &= picked[:, :c]
            keys = torch.cat((keys, _paged(cmp_kv, cmp_block_table[b], c)))
            visible = torch.cat((visible.expand(n, -1), entry_visible), dim=1)
        scores = torch.einsum("thd,kd->thk", q[a:e].float(), keys) * softmax_scale
        scores = scores.masked_fill(~visible.expand(n, -1)[:, None], float("-inf"))
        logits = torch.cat((scores, sinks.view(1, -1, 1).expand(n, -1, 1)), dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out[a:e] = torch.einsum("thk,kd->thd", probs, keys).to(q.dtype)
    return out, torch.zeros(1, dtype=torch.float32)


# -- torch_npu ops ----------------------------------------------------------------------------------

_NORMS = {0: lambda x: x.softmax(dim=-1), 1: torch.sigmoid, 2: lambda x: F.softplus(x).sqrt()}


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """norm = softmax / sigmoid / sqrt(softplus) of x; experts = top-k of norm + bias (or tid2eid[input_ids]);
    y = their norm values (renormalised for types 1 and 2) times routed_scaling_factor."""
    need(x.dim() == 2 and x.shape[1] <= 2048 and 1 <= k <= x.shape[1], "x [T, E <= 2048], 1 <= k <= E")
    need(norm_type in _NORMS and renorm == 0 and k_group == group_count == 1, "norm_type 0/1/2, renorm 0, one group")
    norm = _NORMS[norm_type](x.float())
    if tid2eid is not None:
        need(tid2eid.dtype == torch.int32 and tid2eid.shape[1] == k <= 64, "tid2eid int32 [vocab, k <= 64]")
        need(input_ids is not None and input_ids.dtype == torch.int64, "hash mode needs int64 input_ids")
        ids = tid2eid[input_ids].long()
    else:
        need(bias is None or (bias.dtype == torch.float32 and bias.shape == (x.shape[1],)), "bias fp32 [E]")
        ids = torch.topk(norm + (bias if bias is not None else 0), k, dim=-1).indices
    y = norm.gather(1, ids)
    if norm_type in (1, 2):
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    return (y * routed_scaling_factor).to(x.dtype), ids.to(torch.int32), norm if out_flag else None


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=0, active_expert_range=(), row_idx_type=0):
    """Rows `r = t * K + j` sorted by expert (stable); `expanded_row_idx[r]` is row r's place in
    `expanded_x` (row_idx_type 0); counts per expert (expert_tokens_num_type 1)."""
    need(x.dim() == 2 and expert_idx.dim() == 2 and expert_idx.dtype == torch.int32, "x 2-D, expert_idx int32 2-D")
    need(0 < expert_num <= 10240 and quant_mode == -1 and drop_pad_mode == 0, "expert_num <= 10240, no quant/drop")
    need(expert_tokens_num_type == 1 and expert_tokens_num_flag and row_idx_type == 0, "counts, row_idx_type 0")
    need(list(active_expert_range) == [0, expert_num], "every expert active on this rank")
    flat = expert_idx.flatten().long()
    order = torch.sort(flat, stable=True).indices
    expanded_row_idx = torch.empty_like(order)
    expanded_row_idx[order] = torch.arange(len(order))
    counts = torch.bincount(flat, minlength=expert_num).to(torch.int64)
    return x[order // expert_idx.shape[1]], expanded_row_idx.to(torch.int32), counts, torch.empty(0)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, per_token_scale=None,
                       group_list=None, split_item=0, group_type=None, group_list_type=0, output_dtype=None, **_):
    """Single-tensor split-M grouped matmul: the rows of group e (counts) times `weight[e]` `[K, N]`."""
    need(split_item in (2, 3) and len(x) == 1 and len(weight) == 1, "split_item 2/3: one x and one weight tensor")
    need(group_type == 0 and group_list_type == 1 and group_list.dtype == torch.int64, "split M by int64 counts")
    rows, w = x[0], weight[0]
    need(rows.dtype in HALF and w.dtype == rows.dtype, "bf16/fp16 x and weight of one dtype")
    need(w.dim() == 3 and w.shape[1] == rows.shape[1] and w.shape[0] == len(group_list), "weight [E, K, N]")
    out = torch.zeros(rows.shape[0], w.shape[2], dtype=rows.dtype)
    start = 0
    for e, count in enumerate(group_list.tolist()):
        out[start:start + count] = (rows[start:start + count].float() @ w[e].float()).to(rows.dtype)
        start += count
    return [out]


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """`(x * rsqrt(mean(x^2) + eps) * gamma, rstd)` computed in fp32; y in x's dtype."""
    need(gamma.shape == (x.shape[-1],), "gamma [D]")
    rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + epsilon)
    return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    """`x * r1 + rotate(x) * r2`; interleave mode rotates pairs `(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])`."""
    need(rotary_mode == "interleave" and x.shape[-1] < 896 and x.dim() in (3, 4), "interleave, D < 896, 3-/4-D x")
    need(r1.shape == r2.shape and r1.shape[-1] == x.shape[-1], "r1/r2 broadcast to x with D channels")
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * r1 + rotated * r2


def register_npu_device_name() -> None:
    """Let `torch.device("npu")` parse, as importing torch_npu does (it renames torch's privateuse1
    backend); nothing is registered to run on it. Once per process."""
    try:
        torch.device("npu")
    except RuntimeError:
        torch.utils.rename_privateuse1_backend("npu")


def torch_npu_module(soc_version: int = 260, is_available: bool = True) -> types.ModuleType:
    """A stand-in `torch_npu` exposing the ops above and the `npu` namespace the plugin reads."""
    module = types.ModuleType("torch_npu")
    module.npu = types.SimpleNamespace(is_available=lambda: is_available, get_soc_version=lambda: soc_version,
                                       set_device=lambda device: None)
    for op in (npu_moe_gating_top_k, npu_moe_init_routing_v2, npu_grouped_matmul, npu_rms_norm, npu_rotary_mul):
        setattr(module, op.__name__, op)
    return module


def cann_ops_module() -> types.ModuleType:
    """A stand-in `cann_ops_transformer` exposing `sparse_flash_mla` and its metadata op."""
    module = types.ModuleType("cann_ops_transformer")
    module.sparse_flash_mla, module.sparse_flash_mla_metadata = sparse_flash_mla, sparse_flash_mla_metadata
    return module
