"""Triton kernels of the routed MoE: routing, and the two grouped GEMMs over expert-sorted rows.

Rows are the flat `(token, k)` pairs, `row = token * top_k + k`. `sort_rows_by_expert` (in `moe.py`)
lays them out expert by expert, each expert's run padded to a multiple of `BLOCK_M`, so one program
block of rows belongs to one expert and reads that expert's weight tile once for all its rows.

With `FP4` the expert weights are packed e2m1 codes (two a byte, low nibble = even input column) with
one e8m0 scale per 32 input columns (passed as uint8: the scale's biased exponent); each weight tile is
decoded to the activation dtype in registers right before its `tl.dot`, so HBM carries half a byte per
weight plus 1/32 byte of scale (weight-only quantisation: activations stay in their dtype). A tile's
bytes are loaded once, contiguously, and split into the even (low nibble) and odd (high nibble) input
columns, which meet the activations' even and odd columns in two dots of half width (a dot's terms may
add in any order); its scales are loaded once per 32 inputs and added to the decoded values' exponent
fields (`_fp4_values`), with no multiply.
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
def _fp4_values(code, scale_exponent, dtype: tl.constexpr):
    """e2m1 `code`s times 2^(`scale_exponent` - 127), built as float32 bits by adding the scale to the
    exponent field (no multiply): magnitude index `e << 1 | m` is `m / 2` when `e == 0`, else
    `(1 + m / 2) * 2^(e - 1)`."""
    e = (code >> 1) & 0x3
    m = code & 0x1
    exponent = tl.where(e == 0, scale_exponent - 1, e - 1 + scale_exponent)
    bits = (exponent << 23) | tl.where(e == 0, 0, m << 22)
    bits = tl.where((code & 0x7) == 0, 0, bits) | ((code >> 3) << 31)
    return bits.to(tl.float32, bitcast=True).to(dtype)


@triton.jit
def _fp4_halves(w_ptrs, s_ptrs, w_mask, s_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                dtype: tl.constexpr):
    """The even and the odd input columns `[BLOCK_N, BLOCK_K // 2]` of a packed FP4 tile: each byte and
    each e8m0 scale loaded once (`w_ptrs` over the tile's bytes, `s_ptrs` over its `BLOCK_K // 32` scales
    a row), the low nibble the even column, the high nibble the odd one."""
    packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.int32) & 0xFF
    scales = tl.load(s_ptrs, mask=s_mask, other=0).to(tl.int32)
    scales = tl.reshape(tl.broadcast_to(scales[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)),
                        (BLOCK_N, BLOCK_K // 2))
    return _fp4_values(packed & 0xF, scales, dtype), _fp4_values(packed >> 4, scales, dtype)


@triton.jit
def _dot(acc, a, b, IEEE: tl.constexpr):
    """`acc + a @ b.T`."""
    if IEEE:
        return acc + tl.dot(a, tl.trans(b), input_precision="ieee")
    return acc + tl.dot(a, tl.trans(b))


@triton.jit
def swiglu(acc_g, acc_u, swiglu_limit, HAS_LIMIT: tl.constexpr):
    """`silu(min(g, limit)) * clamp(u, -limit, limit)`, elementwise (any layout)."""
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, swiglu_limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -swiglu_limit), swiglu_limit)
    return acc_g * tl.sigmoid(acc_g) * acc_u


@triton.jit
def store_swiglu(acc_g, acc_u, act_ptr, offs_m, offs_n, n_valid, stride_act, swiglu_limit, HAS_LIMIT: tl.constexpr):
    """The gate_up GEMMs' epilogue: `act[slot, n] = silu(min(g, limit)) * clamp(u, -limit, limit)`."""
    act = swiglu(acc_g, acc_u, swiglu_limit, HAS_LIMIT)
    act_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_n[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_valid[None, :])


@triton.jit
def store_weighted(acc, out_ptr, rows, row_valid, row_weights_ptr, offs_n, n_valid, stride_out):
    """The down GEMMs' epilogue: each row times its routing weight, written at the row's original place."""
    weights = tl.load(row_weights_ptr + rows, mask=row_valid, other=0.0)
    acc = acc * weights[:, None]
    safe_rows = tl.where(row_valid, rows, 0).to(tl.int64)
    out_ptrs = out_ptr + safe_rows[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=row_valid[:, None] & n_valid[None, :])


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
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP4:  # the even and odd input columns as two dots of half width: no interleave, each byte loaded once
        offs_h, offs_s = tl.arange(0, BLOCK_K // 2), tl.arange(0, BLOCK_K // 32)
        x_ptrs = x_ptr + tokens[:, None].to(tl.int64) * stride_x + 2 * offs_h[None, :]
        g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_h[None, :]
        gs_ptrs = s_ptr + expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn + offs_s[None, :]
        u_ptrs, us_ptrs = g_ptrs + inter * stride_wn, gs_ptrs + inter * stride_sn
        for k0 in range(0, hidden, BLOCK_K):
            h_valid = (k0 + 2 * offs_h) < hidden
            x_mask = row_valid[:, None] & h_valid[None, :]
            x_even = tl.load(x_ptrs, mask=x_mask, other=0.0)
            x_odd = tl.load(x_ptrs + 1, mask=x_mask, other=0.0)
            w_mask = n_valid[:, None] & h_valid[None, :]
            s_mask = n_valid[:, None] & ((k0 + 32 * offs_s) < hidden)[None, :]
            g_even, g_odd = _fp4_halves(g_ptrs, gs_ptrs, w_mask, s_mask, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty)
            u_even, u_odd = _fp4_halves(u_ptrs, us_ptrs, w_mask, s_mask, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty)
            acc_g = _dot(_dot(acc_g, x_even, g_even, IEEE), x_odd, g_odd, IEEE)
            acc_u = _dot(_dot(acc_u, x_even, u_even, IEEE), x_odd, u_odd, IEEE)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K // 2
            u_ptrs += BLOCK_K // 2
            gs_ptrs += BLOCK_K // 32
            us_ptrs += BLOCK_K // 32
    else:
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tokens[:, None].to(tl.int64) * stride_x + offs_k[None, :]
        g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
        u_ptrs = g_ptrs + inter * stride_wn
        for k0 in range(0, hidden, BLOCK_K):
            k_valid = (k0 + offs_k) < hidden
            x = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w_mask = n_valid[:, None] & k_valid[None, :]
            wg = tl.load(g_ptrs, mask=w_mask, other=0.0)
            wu = tl.load(u_ptrs, mask=w_mask, other=0.0)
            acc_g = _dot(acc_g, x, wg, IEEE)
            acc_u = _dot(acc_u, x, wu, IEEE)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    store_swiglu(acc_g, acc_u, act_ptr, offs_m, offs_n, n_valid, stride_act, swiglu_limit, HAS_LIMIT)


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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP4:  # as in gate_up_kernel: even and odd input columns, two dots of half width
        offs_h, offs_s = tl.arange(0, BLOCK_K // 2), tl.arange(0, BLOCK_K // 32)
        a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_act + 2 * offs_h[None, :]
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_h[None, :]
        s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn + offs_s[None, :]
        for k0 in range(0, inter, BLOCK_K):
            h_valid = (k0 + 2 * offs_h) < inter
            a_mask = row_valid[:, None] & h_valid[None, :]
            a_even = tl.load(a_ptrs, mask=a_mask, other=0.0)
            a_odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0)
            s_mask = n_valid[:, None] & ((k0 + 32 * offs_s) < inter)[None, :]
            w_even, w_odd = _fp4_halves(w_ptrs, s_ptrs, n_valid[:, None] & h_valid[None, :], s_mask,
                                        BLOCK_N, BLOCK_K, act_ptr.dtype.element_ty)
            acc = _dot(_dot(acc, a_even, w_even, IEEE), a_odd, w_odd, IEEE)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 32
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_k[None, :]
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
        for k0 in range(0, inter, BLOCK_K):
            k_valid = (k0 + offs_k) < inter
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_valid[:, None] & k_valid[None, :], other=0.0)
            acc = _dot(acc, a, w, IEEE)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    store_weighted(acc, out_ptr, rows, row_valid, row_weights_ptr, offs_n, n_valid, stride_out)
