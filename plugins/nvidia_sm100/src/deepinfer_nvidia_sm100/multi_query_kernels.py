"""Multi-query decode attention: every request brings the same few query tokens (a verification step:
its last token and its drafts, causal among themselves), for the layers whose keys the queries share.

`attention_kernel` gives each query token its own program, so a request's q tokens each read its
window (and, on HCA layers, its compressed entries) once. Here one program takes all q tokens of a
request and `BLOCK_H` heads as the rows of its matrix products (`q * BLOCK_H` rows) and walks the union
of their keys once: the window positions `start - window + 1 .. start + q - 1` (the ring for positions
before the step, this step's `kv` after), then the compressed entries the last query can see. Each row
masks what its own token may not see (positions after it or before its window, entries not closed by
its position), which keeps the queries causal among themselves. CSA layers (each query its own top-k
entries, so little to share) stay on `attention_kernel`. Splits and their merge are `attention_kernel`'s
(`combine_kernel` merges the partial states per token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.attention_kernels import attend_block

MAX_WIDTH = 8
"""Most query tokens a request may bring to this path (k + 1 for k <= 7)."""
ROWS = 64
"""Rows of a program's matrix products: query tokens x heads."""


@triton.jit
def multi_query_kernel(
    q_ptr, kv_ptr, window_ptr, comp_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    start_pos_ptr, slots_ptr, win_start_ptr, block_tables_ptr,
    num_heads, head_dim, scale, num_comp,
    stride_qt, stride_qh, stride_kv, stride_ws, stride_wp, stride_comp, stride_bt, stride_ot, stride_oh,
    WIDTH: tl.constexpr, WIDTH_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, RATE: tl.constexpr, EPB: tl.constexpr,
    HAS_COMP: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_WIN_START: tl.constexpr, IEEE: tl.constexpr,
):
    req = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    start = tl.load(start_pos_ptr + req)
    slot = tl.load(slots_ptr + req)
    if HAS_WIN_START:
        win_lo = tl.maximum(tl.load(win_start_ptr + req), 0)
    else:
        win_lo = 0
    q_start = req * WIDTH
    last = start + WIDTH - 1

    rows = tl.arange(0, WIDTH_POW2 * BLOCK_H)
    t = rows // BLOCK_H  # the row's query token within the request
    offs_h = head_block * BLOCK_H + rows % BLOCK_H
    row_valid = (t < WIDTH) & (offs_h < num_heads)
    pos = start + t  # the row's query position
    offs_d = tl.arange(0, HEAD_DIM)
    d_valid = offs_d < head_dim
    token = q_start + tl.where(t < WIDTH, t, 0)
    q = tl.load(q_ptr + token[:, None] * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    num_window = WINDOW + WIDTH - 1  # the union of the queries' windows
    num_keys = num_window
    if HAS_COMP:
        num_keys += tl.minimum(num_comp, (last + 1) // RATE)
    m_i = tl.full([WIDTH_POW2 * BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([WIDTH_POW2 * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([WIDTH_POW2 * BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for j0 in range(split * BLOCK_N, num_keys, num_splits * BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        in_window = j < num_window
        p = start - WINDOW + 1 + j
        win_valid = in_window & (p >= win_lo)
        from_ring = p < start
        ring_ptrs = window_ptr + slot * stride_ws + (tl.where(p >= 0, p, 0) % WINDOW) * stride_wp
        new_ptrs = kv_ptr + (q_start + tl.where(from_ring, 0, p - start)).to(tl.int64) * stride_kv
        ptrs = tl.where(from_ring, ring_ptrs, new_ptrs)
        sees = win_valid[None, :] & (p[None, :] <= pos[:, None]) & (p[None, :] > pos[:, None] - WINDOW)
        valid = win_valid
        if HAS_COMP:
            entry = j - num_window
            comp_valid = (entry >= 0) & (entry < num_comp) & (entry < (last + 1) // RATE)
            entry = tl.where(comp_valid, entry, 0)
            block = tl.load(block_tables_ptr + req * stride_bt + entry // EPB, mask=comp_valid, other=0)
            comp_ptrs = comp_ptr + (block * EPB + entry % EPB).to(tl.int64) * stride_comp
            ptrs = tl.where(in_window, ptrs, comp_ptrs)
            valid = valid | comp_valid
            sees = sees | (comp_valid[None, :] & (entry[None, :] < (pos[:, None] + 1) // RATE))
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            k = tl.load(ptrs[:, None] + offs_d[None, :], mask=valid[:, None] & d_valid[None, :], other=0.0)
            m_i, l_i, acc = attend_block(q, k, sees, scale, m_i, l_i, acc, IEEE)

    if not IS_SPLIT:
        sinks = tl.load(sinks_ptr + offs_h, mask=row_valid, other=0.0)
        out = acc / (l_i + tl.exp(sinks - m_i))[:, None]
        out_ptrs = out_ptr + token[:, None] * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    else:  # partials as attention_kernel writes them: acc [T, S, H, D], (m, l) [T, S, 2, H]
        base = (token * num_splits + split).to(tl.int64)
        acc_ptrs = part_acc_ptr + (base[:, None] * num_heads + offs_h[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=row_valid[:, None])
        tl.store(part_ml_ptr + (base * 2) * num_heads + offs_h, m_i, mask=row_valid)
        tl.store(part_ml_ptr + (base * 2 + 1) * num_heads + offs_h, l_i, mask=row_valid)


def uniform_width(metadata, num_tokens: int) -> int:
    """Query tokens per request when every request brings the same number, 2 .. `MAX_WIDTH` (else 0).
    Reads only `query_lens`, the step's shape (static under CUDA graphs)."""
    num_seqs = metadata.num_seqs
    if num_seqs == 0 or num_tokens % num_seqs:
        return 0
    width = num_tokens // num_seqs
    if not 2 <= width <= MAX_WIDTH or any(n != width for n in metadata.query_lens):
        return 0
    return width


def launch(backend, q, kv, window, compressed, sinks, metadata, num_comp: int, width: int,
           win_start: torch.Tensor | None) -> torch.Tensor:
    """Attention of a uniform multi-query step through `multi_query_kernel` (`backend`: the
    `TritonAttention` whose spec, splits and combine it shares); `[T, H, D]` like `forward`."""
    from deepinfer_nvidia_sm100.attention_kernels import combine_kernel

    spec = backend.spec
    num_tokens, num_seqs = q.shape[0], q.shape[0] // width
    width_pow2 = triton.next_power_of_2(width)
    block_h = max(1, ROWS // width_pow2)
    block_n = backend._block_n
    out = torch.empty(num_tokens, spec.num_heads, spec.head_dim, dtype=q.dtype, device=q.device)
    # a program per request and head block: split the keys until the grid fills the device
    num_splits = backend._num_splits(num_seqs, spec.sliding_window + width + num_comp, block_h, block_n)
    part_acc = part_ml = out
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_splits, spec.num_heads, backend._head_dim_pow2,
                               dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_tokens, num_splits, 2, spec.num_heads, dtype=torch.float32, device=q.device)
    has_comp = compressed is not None and num_comp > 0
    comp = compressed if has_comp else kv
    tables = metadata.block_tables
    multi_query_kernel[(num_seqs, triton.cdiv(spec.num_heads, block_h), num_splits)](
        q, kv, window, comp, sinks, out, part_acc, part_ml,
        metadata.start_positions, metadata.slots, win_start if win_start is not None else metadata.slots, tables,
        spec.num_heads, spec.head_dim, backend.scale, num_comp,
        q.stride(0), q.stride(1), kv.stride(0), window.stride(0), window.stride(1), comp.stride(0),
        tables.stride(0), out.stride(0), out.stride(1),
        WIDTH=width, WIDTH_POW2=width_pow2, HEAD_DIM=backend._head_dim_pow2, BLOCK_H=block_h, BLOCK_N=block_n,
        WINDOW=spec.sliding_window, RATE=max(spec.compress_rate, 1), EPB=max(spec.entries_per_block, 1),
        HAS_COMP=has_comp, IS_SPLIT=num_splits > 1, HAS_WIN_START=win_start is not None,
        IEEE=backend._ieee, num_warps=8 if backend._head_dim_pow2 >= 256 else 4, num_stages=2,
    )
    if num_splits > 1:
        combine_kernel[(num_tokens, spec.num_heads)](
            part_acc, part_ml, sinks, out, spec.num_heads, spec.head_dim, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=backend._head_dim_pow2, NUM_SPLITS_POW2=triton.next_power_of_2(num_splits),
        )
    return out
