"""Triton kernels of batch-invariant V4 attention (deterministic mode).

A query token's keys are the virtual list of `attention_kernels` (window positions `pos - window + 1 ..
pos`, then its compressed entries), cut into splits of `SPLIT_KEYS` consecutive items: split `s` holds
items `[s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS)`. The list and its cut depend on the token alone (its
position, its own keys), never on the step's other tokens, the launch bound or the chunking. Each split's
softmax state `(m, l, acc)` is computed from scratch by `_split_state` (blocks of `BLOCK_N` items in
order), then the states are folded, in ascending split order and starting from the sink, by `_fold`,
written with explicit fused multiply-adds so no compiler contraction can differ between kernels.

Two launch shapes give the same bits: `FOLD_IN_PROGRAM` (one program walks all its token's splits and
folds them in registers; big steps) or one program a split storing its state, and `ordered_combine_kernel`
folding the stored states (small steps, where splits spread the work over the GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_nvidia_sm100.attention_kernels import _key_rows, attend_block


@triton.jit
def _fold(big_m, big_l, big_acc, m, l, acc):
    """Fold one split's state `(m, l, acc)` into the running `(big_m, big_l, big_acc)` (elementwise)."""
    new_m = tl.maximum(big_m, m)
    a = tl.exp(big_m - new_m)
    b = tl.exp(m - new_m)
    big_l = tl.fma(l, b, big_l * a)
    big_acc = tl.fma(acc, b[:, None], big_acc * a[:, None])
    return new_m, big_l, big_acc


@triton.jit
def _num_keys(pos, num_comp, WINDOW: tl.constexpr, RATE: tl.constexpr, IS_SPARSE: tl.constexpr,
              HAS_COMP: tl.constexpr):
    """Length of the token's virtual key list (its window, then the entries it may see)."""
    num_keys = WINDOW
    if HAS_COMP:
        if IS_SPARSE:
            num_keys += num_comp
        else:
            num_keys += tl.minimum(num_comp, (pos + 1) // RATE)
    return num_keys


@triton.jit
def _split_state(q, lo, hi, pos, req, start_pos, q_start, slot, win_lo, kv_ptr, window_ptr, comp_ptr, topk_ptr,
                 block_tables_ptr, token, stride_kv, stride_ws, stride_wp, stride_comp, stride_topk, stride_bt,
                 num_comp, scale, offs_d, d_valid,
                 BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                 RATE: tl.constexpr, EPB: tl.constexpr, IS_SPARSE: tl.constexpr, HAS_COMP: tl.constexpr,
                 IEEE: tl.constexpr):
    """Online-softmax state `(m, l, acc)` of virtual keys `[lo, hi)` alone, from an empty state."""
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        row_ptrs, valid = _key_rows(j, pos, req, start_pos, q_start, slot, win_lo, kv_ptr, window_ptr, comp_ptr,
                                    topk_ptr, block_tables_ptr, token, stride_kv, stride_ws, stride_wp,
                                    stride_comp, stride_topk, stride_bt, num_comp, WINDOW, RATE, EPB,
                                    IS_SPARSE, HAS_COMP)
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            k = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=valid[:, None] & d_valid[None, :], other=0.0)
            m_i, l_i, acc = attend_block(q, k, valid[None, :], scale, m_i, l_i, acc, IEEE)
    return m_i, l_i, acc


@triton.jit
def invariant_attention_kernel(
    q_ptr, kv_ptr, window_ptr, comp_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    token_req_ptr, positions_ptr, start_pos_ptr, q_start_ptr, slots_ptr, win_start_ptr, block_tables_ptr, topk_ptr,
    num_heads, head_dim, scale, num_comp,
    stride_qt, stride_qh, stride_kv, stride_ws, stride_wp, stride_comp, stride_bt, stride_topk, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    WINDOW: tl.constexpr, RATE: tl.constexpr, EPB: tl.constexpr, IS_SPARSE: tl.constexpr, HAS_COMP: tl.constexpr,
    FOLD_IN_PROGRAM: tl.constexpr, IS_DECODE: tl.constexpr, HAS_WIN_START: tl.constexpr, IEEE: tl.constexpr,
):
    """Grid `(tokens, head blocks, splits)`: with `FOLD_IN_PROGRAM` (one split in the grid) the program folds
    all its token's splits and stores the output; else program `s` stores split `s`'s state (if the token
    has that split) as `acc [T, S, H, D]`, `(m, l) [T, S, 2, H]`."""
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
    win_lo = 0
    if HAS_WIN_START:
        win_lo = tl.maximum(tl.load(win_start_ptr + req), 0)
    num_keys = _num_keys(pos, num_comp, WINDOW, RATE, IS_SPARSE, HAS_COMP)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = offs_h < num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    d_valid = offs_d < head_dim
    q = tl.load(q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_valid[:, None] & d_valid[None, :], other=0.0)
    if FOLD_IN_PROGRAM:
        big_m = tl.load(sinks_ptr + offs_h, mask=h_valid, other=0.0).to(tl.float32)
        big_l = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
        big_acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        for lo in range(0, num_keys, SPLIT_KEYS):
            m, l, acc = _split_state(q, lo, tl.minimum(lo + SPLIT_KEYS, num_keys), pos, req, start_pos, q_start,
                                     slot, win_lo, kv_ptr, window_ptr, comp_ptr, topk_ptr, block_tables_ptr, token,
                                     stride_kv, stride_ws, stride_wp, stride_comp, stride_topk, stride_bt, num_comp,
                                     scale, offs_d, d_valid, BLOCK_H, HEAD_DIM, BLOCK_N, WINDOW, RATE, EPB,
                                     IS_SPARSE, HAS_COMP, IEEE)
            big_m, big_l, big_acc = _fold(big_m, big_l, big_acc, m, l, acc)
        out = big_acc / big_l[:, None]
        out_ptrs = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & d_valid[None, :])
    else:
        lo = split * SPLIT_KEYS
        if lo < num_keys:
            m, l, acc = _split_state(q, lo, tl.minimum(lo + SPLIT_KEYS, num_keys), pos, req, start_pos, q_start,
                                     slot, win_lo, kv_ptr, window_ptr, comp_ptr, topk_ptr, block_tables_ptr, token,
                                     stride_kv, stride_ws, stride_wp, stride_comp, stride_topk, stride_bt, num_comp,
                                     scale, offs_d, d_valid, BLOCK_H, HEAD_DIM, BLOCK_N, WINDOW, RATE, EPB,
                                     IS_SPARSE, HAS_COMP, IEEE)
            base = (token * tl.num_programs(2) + split).to(tl.int64)
            acc_ptrs = part_acc_ptr + (base * num_heads + offs_h[:, None]) * HEAD_DIM + offs_d[None, :]
            tl.store(acc_ptrs, acc, mask=h_valid[:, None])
            tl.store(part_ml_ptr + (base * 2) * num_heads + offs_h, m, mask=h_valid)
            tl.store(part_ml_ptr + (base * 2 + 1) * num_heads + offs_h, l, mask=h_valid)


@triton.jit
def ordered_combine_kernel(
    part_acc_ptr, part_ml_ptr, sinks_ptr, positions_ptr, out_ptr, num_heads, head_dim, num_comp, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT_KEYS: tl.constexpr, WINDOW: tl.constexpr,
    RATE: tl.constexpr, IS_SPARSE: tl.constexpr, HAS_COMP: tl.constexpr,
):
    """Grid `(tokens, head blocks)`: fold the token's own split states, in split order, onto the sink."""
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = offs_h < num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    pos = tl.load(positions_ptr + token)
    num_keys = _num_keys(pos, num_comp, WINDOW, RATE, IS_SPARSE, HAS_COMP)
    big_m = tl.load(sinks_ptr + offs_h, mask=h_valid, other=0.0).to(tl.float32)
    big_l = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    big_acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for split in range(tl.cdiv(num_keys, SPLIT_KEYS)):
        base = (token * num_splits + split).to(tl.int64)
        acc = tl.load(part_acc_ptr + (base * num_heads + offs_h[:, None]) * HEAD_DIM + offs_d[None, :],
                      mask=h_valid[:, None], other=0.0)
        m = tl.load(part_ml_ptr + (base * 2) * num_heads + offs_h, mask=h_valid, other=-1.0e30)
        l = tl.load(part_ml_ptr + (base * 2 + 1) * num_heads + offs_h, mask=h_valid, other=0.0)
        big_m, big_l, big_acc = _fold(big_m, big_l, big_acc, m, l, acc)
    out = big_acc / big_l[:, None]
    out_ptrs = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & (offs_d < head_dim)[None, :])
