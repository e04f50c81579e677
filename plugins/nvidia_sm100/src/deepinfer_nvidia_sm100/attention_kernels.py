"""Triton kernels of V4 attention: window + compressed entries with sinks, and the CSA indexer scores.

All query heads share one K=V head, so a program takes one query token and `BLOCK_H` heads as the rows
of its matrix products, and walks that token's keys: a virtual list whose first `window` items are the
window positions `pos - window + 1 .. pos` (read from the request's ring, or from this step's `kv` for
positions at or after the request's first new token) and whose next `num_comp` items are compressed
entries (the indexer's picks for CSA, entries `0..` for HCA), read through the block table. A program stops
at its own token's last visible key (the launch is sized for the step's bound, which under CUDA graphs
is the static `max_model_len`). With more than one split (decode, few tokens) split `s` of `S` walks key
blocks `s, s + S, ...`, so the splits share the real keys evenly whatever the bound, and writes a
partial softmax state that `combine_kernel` merges with the sink.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_block(q, k, visible, scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One block of keys `k` into the online softmax (`m_i`, `l_i`, `acc`): the scores of `q` against
    `k` (times `scale`) where `visible`, none elsewhere."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
    return m_new, l_i, acc


@triton.jit
def _key_rows(
    j,
    pos,
    req,
    start_pos,
    q_start,
    slot,
    win_lo,
    kv_ptr,
    window_ptr,
    comp_ptr,
    topk_ptr,
    block_tables_ptr,
    token,
    stride_kv,
    stride_ws,
    stride_wp,
    stride_comp,
    stride_topk,
    stride_bt,
    num_comp,
    WINDOW: tl.constexpr,
    RATE: tl.constexpr,
    EPB: tl.constexpr,
    IS_SPARSE: tl.constexpr,
    HAS_COMP: tl.constexpr,
):
    """Row pointers and validity of virtual keys `j` ([BLOCK_N]) of one query token."""
    in_window = j < WINDOW
    p = pos - WINDOW + 1 + j
    win_valid = in_window & (p >= win_lo)
    from_ring = p < start_pos
    ring_ptrs = window_ptr + slot * stride_ws + (tl.where(p >= 0, p, 0) % WINDOW) * stride_wp
    new_ptrs = kv_ptr + (q_start + tl.where(from_ring, 0, p - start_pos)).to(tl.int64) * stride_kv
    ptrs = tl.where(from_ring, ring_ptrs, new_ptrs)
    valid = win_valid
    if HAS_COMP:
        c = j - WINDOW
        in_comp = (c >= 0) & (c < num_comp)
        if IS_SPARSE:
            entry = tl.load(topk_ptr + token * stride_topk + c, mask=in_comp, other=-1)
        else:
            entry = tl.where(in_comp, c, -1)
        comp_valid = in_comp & (entry >= 0) & (entry < (pos + 1) // RATE)
        entry = tl.where(comp_valid, entry, 0)
        block = tl.load(block_tables_ptr + req * stride_bt + entry // EPB, mask=comp_valid, other=0)
        comp_ptrs = comp_ptr + (block * EPB + entry % EPB).to(tl.int64) * stride_comp
        ptrs = tl.where(in_window, ptrs, comp_ptrs)
        valid = valid | comp_valid
    return ptrs, valid


@triton.jit
def attention_kernel(
    q_ptr,
    kv_ptr,
    window_ptr,
    comp_ptr,
    sinks_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    token_req_ptr,
    positions_ptr,
    start_pos_ptr,
    q_start_ptr,
    slots_ptr,
    win_start_ptr,
    block_tables_ptr,
    topk_ptr,
    num_heads,
    head_dim,
    scale,
    num_comp,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_ws,
    stride_wp,
    stride_comp,
    stride_bt,
    stride_topk,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    RATE: tl.constexpr,
    EPB: tl.constexpr,
    IS_SPARSE: tl.constexpr,
    HAS_COMP: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    IS_DECODE: tl.constexpr,
    HAS_WIN_START: tl.constexpr,
    IEEE: tl.constexpr,
):
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(positions_ptr + token)
    if IS_DECODE:
        req = token
        start_pos = pos
        q_start = token
    else:
        req = tl.load(token_req_ptr + token)
        start_pos = tl.load(start_pos_ptr + req)
        q_start = tl.load(q_start_ptr + req)
    slot = tl.load(slots_ptr + req)
    if HAS_WIN_START:
        win_lo = tl.maximum(tl.load(win_start_ptr + req), 0)
    else:
        win_lo = 0
    # keys this token can see: its window, then its compressed entries (HCA: only those closed so far)
    num_keys = WINDOW
    if HAS_COMP:
        if IS_SPARSE:
            num_keys += num_comp
        else:
            num_keys += tl.minimum(num_comp, (pos + 1) // RATE)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = offs_h < num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    d_valid = offs_d < head_dim
    q_ptrs = q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_valid[:, None] & d_valid[None, :], other=0.0)
    num_splits = tl.num_programs(2)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for j0 in range(split * BLOCK_N, num_keys, num_splits * BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        row_ptrs, valid = _key_rows(
            j,
            pos,
            req,
            start_pos,
            q_start,
            slot,
            win_lo,
            kv_ptr,
            window_ptr,
            comp_ptr,
            topk_ptr,
            block_tables_ptr,
            token,
            stride_kv,
            stride_ws,
            stride_wp,
            stride_comp,
            stride_topk,
            stride_bt,
            num_comp,
            WINDOW,
            RATE,
            EPB,
            IS_SPARSE,
            HAS_COMP,
        )
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            k = tl.load(
                row_ptrs[:, None] + offs_d[None, :], mask=valid[:, None] & d_valid[None, :], other=0.0
            )
            m_i, l_i, acc = attend_block(q, k, valid[None, :], scale, m_i, l_i, acc, IEEE)

    if not IS_SPLIT:
        sinks = tl.load(sinks_ptr + offs_h, mask=h_valid, other=0.0)
        denom = l_i + tl.exp(sinks - m_i)
        out = acc / denom[:, None]
        out_ptrs = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & d_valid[None, :])
    else:
        # partials: acc [T, S, H, D], (m, l) [T, S, 2, H]
        base = (token * num_splits + split).to(tl.int64)
        acc_ptrs = part_acc_ptr + (base * num_heads + offs_h[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=h_valid[:, None])
        tl.store(part_ml_ptr + (base * 2) * num_heads + offs_h, m_i, mask=h_valid)
        tl.store(part_ml_ptr + (base * 2 + 1) * num_heads + offs_h, l_i, mask=h_valid)


@triton.jit
def combine_kernel(
    part_acc_ptr,
    part_ml_ptr,
    sinks_ptr,
    out_ptr,
    num_heads,
    head_dim,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS_POW2: tl.constexpr,
):
    """Merge the splits' partial softmax states of one (token, head) and add the sink."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS_POW2)
    s_valid = offs_s < num_splits
    base = token.to(tl.int64) * num_splits + offs_s
    m = tl.load(part_ml_ptr + (base * 2) * num_heads + head, mask=s_valid, other=-1.0e30)
    l = tl.load(part_ml_ptr + (base * 2 + 1) * num_heads + head, mask=s_valid, other=0.0)
    sink = tl.load(sinks_ptr + head)
    m_max = tl.maximum(tl.max(m, axis=0), sink)
    scale = tl.where(s_valid, tl.exp(m - m_max), 0.0)
    denom = tl.sum(l * scale, axis=0) + tl.exp(sink - m_max)
    offs_d = tl.arange(0, HEAD_DIM)
    d_valid = offs_d < head_dim
    acc_ptrs = part_acc_ptr + (base[:, None] * num_heads + head) * HEAD_DIM + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=s_valid[:, None] & d_valid[None, :], other=0.0)
    out = tl.sum(acc * scale[:, None], axis=0) / denom
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


@triton.jit
def indexer_scores_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    block_tables_ptr,
    token_req_ptr,
    positions_ptr,
    scores_ptr,
    num_entries_cap,
    n_heads,
    head_dim,
    scale,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_keys,
    stride_bt,
    stride_st,
    N_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    RATE: tl.constexpr,
    EPB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_DECODE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """scores[t, e] = scale * sum_h w[t, h] * relu(q[t, h] . key[e]); -inf for entries not yet visible."""
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    if IS_DECODE:
        req = token
    else:
        req = tl.load(token_req_ptr + token)
    pos = tl.load(positions_ptr + token)
    entry = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cap = entry < num_entries_cap
    if pid_n * BLOCK_N >= (pos + 1) // RATE:  # no visible entry in this block: skip the loads
        tl.store(
            scores_ptr + token * stride_st + entry, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=in_cap
        )
    else:
        offs_h = tl.arange(0, N_HEADS)
        offs_d = tl.arange(0, HEAD_DIM)
        h_valid = offs_h < n_heads
        d_valid = offs_d < head_dim
        q_ptrs = q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=h_valid[:, None] & d_valid[None, :], other=0.0)
        w = tl.load(w_ptr + token * stride_wt + offs_h, mask=h_valid, other=0.0).to(tl.float32)
        visible = entry < (pos + 1) // RATE
        safe = tl.where(visible, entry, 0)
        block = tl.load(block_tables_ptr + req * stride_bt + safe // EPB, mask=visible, other=0)
        rows = (block * EPB + safe % EPB).to(tl.int64)
        k = tl.load(
            keys_ptr + rows[:, None] * stride_keys + offs_d[None, :],
            mask=visible[:, None] & d_valid[None, :],
            other=0.0,
        )
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0) * scale
        score = tl.where(visible, score, float("-inf"))
        tl.store(scores_ptr + token * stride_st + entry, score, mask=in_cap)
