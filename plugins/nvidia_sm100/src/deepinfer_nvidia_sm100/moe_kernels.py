"""Triton kernels of the routed MoE: routing, and the two grouped GEMMs over expert-sorted rows.

Rows are the flat `(token, k)` pairs, `row = token * top_k + k`. `sort_rows_by_expert` (in `moe.py`)
lays them out expert by expert, each expert's run padded to a multiple of `BLOCK_M`, so one program
block of rows belongs to one expert and reads that expert's weight tile once for all its rows.

With `FP4` the expert weights are packed e2m1 codes (two a byte, low nibble = even input column) with
one e8m0 scale per 32 input columns (passed as uint8: the scale's biased exponent); each weight tile is
decoded to the activation dtype in registers right before its `tl.dot`, so HBM carries half a byte per
weight plus 1/32 byte of scale (weight-only quantisation: activations stay in their dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

SCORING_CODES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@triton.jit
def route_kernel(
    logits_ptr,
    bias_ptr,
    tid2eid_ptr,
    input_ids_ptr,
    ids_out_ptr,
    weights_out_ptr,
    num_experts,
    routed_scaling_factor,
    TOP_K: tl.constexpr,
    TOP_K_POW2: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_HASH: tl.constexpr,
):
    """One program per token: score the experts, pick `TOP_K`, normalise and scale the weights."""
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    in_range = offs < num_experts
    logits = tl.load(logits_ptr + token * num_experts + offs, mask=in_range, other=float("-inf")).to(
        tl.float32
    )
    if SCORING == 0:
        shifted = tl.exp(logits - tl.max(logits, axis=0))
        scores = shifted / tl.sum(shifted, axis=0)
    elif SCORING == 1:
        scores = tl.sigmoid(logits)
    else:
        # softplus with torch's threshold of 20, then sqrt
        softplus = tl.where(logits > 20.0, logits, tl.log(1.0 + tl.exp(tl.minimum(logits, 20.0))))
        scores = tl.sqrt(softplus)
    scores = tl.where(in_range, scores, 0.0)
    keys = scores
    if HAS_BIAS:
        keys = keys + tl.load(bias_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
    keys = tl.where(in_range, keys, float("-inf"))
    k_offs = tl.arange(0, TOP_K_POW2)
    picked_weights = tl.zeros([TOP_K_POW2], dtype=tl.float32)
    picked_ids = tl.zeros([TOP_K_POW2], dtype=tl.int32)
    if IS_HASH:
        token_id = tl.load(input_ids_ptr + token)
    for k in tl.static_range(TOP_K):
        if IS_HASH:
            expert = tl.load(tid2eid_ptr + token_id * TOP_K + k).to(tl.int32)
        else:
            best = tl.max(keys, axis=0)
            expert = tl.min(tl.where(keys == best, offs, BLOCK_E), axis=0)
            keys = tl.where(offs == expert, float("-inf"), keys)
        weight = tl.sum(tl.where(offs == expert, scores, 0.0), axis=0)
        picked_weights = tl.where(k_offs == k, weight, picked_weights)
        picked_ids = tl.where(k_offs == k, expert, picked_ids)
    total = tl.sum(picked_weights, axis=0) + 1e-20
    picked_weights = picked_weights / total * routed_scaling_factor
    k_mask = k_offs < TOP_K
    tl.store(ids_out_ptr + token * TOP_K + k_offs, picked_ids, mask=k_mask)
    tl.store(weights_out_ptr + token * TOP_K + k_offs, picked_weights, mask=k_mask)


@triton.jit
def _tile(N_FASTEST: tl.constexpr):
    """`(row block, output tile)` of this program. With `N_FASTEST` (grid `[n tiles, row blocks]`) the
    programs running at once cover all output tiles of a few row blocks, so each block's rows come from
    HBM once; otherwise (grid `[row blocks, n tiles]`) they cover one output tile of many row blocks."""
    if N_FASTEST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _weight_pointers(w_base, s_base, offs_n, offs_k, stride_wn, stride_sn, FP4: tl.constexpr):
    """Pointers of a `[BLOCK_N, BLOCK_K]` weight tile (and, for FP4, of its bytes' scales)."""
    if FP4:
        w_ptrs = w_base + offs_n[:, None] * stride_wn + offs_k[None, :] // 2
        s_ptrs = s_base + offs_n[:, None] * stride_sn + offs_k[None, :] // 32
    else:
        w_ptrs = w_base + offs_n[:, None] * stride_wn + offs_k[None, :]
        s_ptrs = s_base
    return w_ptrs, s_ptrs


@triton.jit
def _load_weights(w_ptrs, s_ptrs, offs_k, mask, dtype: tl.constexpr, FP4: tl.constexpr):
    """A weight tile in `dtype`; FP4 codes are decoded from their bits (no table): magnitude index
    `m = e << 1 | mantissa`, value `mantissa / 2` when `e == 0`, else `(1 + mantissa / 2) * 2^(e - 1)`,
    built as float32 bits; the e8m0 scale `b` is the float32 whose exponent field is `b`."""
    if FP4:
        packed = tl.load(w_ptrs, mask=mask, other=0).to(tl.int32) & 0xFF
        code = (packed >> ((offs_k[None, :] & 1) * 4)) & 0xF
        exponent = (code >> 1) & 0x3
        mantissa = code & 0x1
        normal = ((exponent + 126) << 23) | (mantissa << 22)
        bits = tl.where(exponent == 0, mantissa * 0x3F000000, normal) | ((code >> 3) << 31)
        value = bits.to(tl.float32, bitcast=True)
        scale_bits = tl.load(s_ptrs, mask=mask, other=0).to(tl.int32) << 23
        w = (value * scale_bits.to(tl.float32, bitcast=True)).to(dtype)
    else:
        w = tl.load(w_ptrs, mask=mask, other=0.0)
    return w


@triton.jit
def gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    act_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_rows,
    hidden,
    inter,
    swiglu_limit,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_act,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    IEEE: tl.constexpr,
    N_FASTEST: tl.constexpr,
    FP4: tl.constexpr,
):
    """act[r, n] = silu(min(g, limit)) * clamp(u, -limit, limit), with g, u = gate_up[e] @ x[token(r)]."""
    pid_m, pid_n = _tile(N_FASTEST)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + offs_m)
    row_valid = rows < num_rows
    tokens = tl.where(row_valid, rows // TOP_K, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    g_ptrs, gs_ptrs = _weight_pointers(w_ptr + expert.to(tl.int64) * stride_we,
                                       s_ptr + expert.to(tl.int64) * stride_se,
                                       offs_n, offs_k, stride_wn, stride_sn, FP4)
    u_ptrs, us_ptrs = g_ptrs + inter * stride_wn, gs_ptrs + inter * stride_sn
    W_STEP: tl.constexpr = BLOCK_K // 2 if FP4 else BLOCK_K
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_valid = (k0 + offs_k) < hidden
        x = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = n_valid[:, None] & k_valid[None, :]
        wg = _load_weights(g_ptrs, gs_ptrs, offs_k, w_mask, x_ptr.dtype.element_ty, FP4)
        wu = _load_weights(u_ptrs, us_ptrs, offs_k, w_mask, x_ptr.dtype.element_ty, FP4)
        if IEEE:
            acc_g += tl.dot(x, tl.trans(wg), input_precision="ieee")
            acc_u += tl.dot(x, tl.trans(wu), input_precision="ieee")
        else:
            acc_g += tl.dot(x, tl.trans(wg))
            acc_u += tl.dot(x, tl.trans(wu))
        x_ptrs += BLOCK_K
        g_ptrs += W_STEP
        u_ptrs += W_STEP
        if FP4:
            gs_ptrs += BLOCK_K // 32
            us_ptrs += BLOCK_K // 32
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, swiglu_limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -swiglu_limit), swiglu_limit)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    act_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_n[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_valid[None, :])


@triton.jit
def down_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    row_weights_ptr,
    num_rows,
    hidden,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    N_FASTEST: tl.constexpr,
    FP4: tl.constexpr,
):
    """out[row, n] = weight[row] * (down[e] @ act[r])[n], written at the row's original place."""
    pid_m, pid_n = _tile(N_FASTEST)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + offs_m)
    row_valid = rows < num_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_k[None, :]
    w_ptrs, s_ptrs = _weight_pointers(w_ptr + expert.to(tl.int64) * stride_we,
                                      s_ptr + expert.to(tl.int64) * stride_se,
                                      offs_n, offs_k, stride_wn, stride_sn, FP4)
    W_STEP: tl.constexpr = BLOCK_K // 2 if FP4 else BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_valid = (k0 + offs_k) < inter
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = _load_weights(w_ptrs, s_ptrs, offs_k, n_valid[:, None] & k_valid[None, :],
                          act_ptr.dtype.element_ty, FP4)
        if IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
        a_ptrs += BLOCK_K
        w_ptrs += W_STEP
        if FP4:
            s_ptrs += BLOCK_K // 32
    weights = tl.load(row_weights_ptr + rows, mask=row_valid, other=0.0)
    acc = acc * weights[:, None]
    safe_rows = tl.where(row_valid, rows, 0).to(tl.int64)
    out_ptrs = out_ptr + safe_rows[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=row_valid[:, None] & n_valid[None, :])
