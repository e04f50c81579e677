"""Triton kernels of the layer ops: RMSNorm + RoPE in one pass, and the compressor window close.

Channels of a row are laid out as a `[pairs, 2]` tile (`channel = 2 * pair + j`), so the RoPE partner of
every channel sits in the same tile row: even and odd halves come out with a masked sum over the last
axis and go back with `tl.where`. All math is fp32; values are rounded to the activation dtype where
the reference (`deepinfer_core.reference.layer_ops`) rounds.

Launchers never read device values on the host, so they are safe inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.backends.attention import AttentionMetadata
from deepinfer_core.backends.layer_ops import CompressorWeights

_MAX_TILE = 4096
"""fp32 elements of one `[rows, channels]` tile of the window pooling."""
_REQUEST_SCAN = 64
"""Request ends `_request_of` reads per loop step. Fixed, like `num_seqs` left unspecialised, so one
compile of each kernel that finds a token's request serves every batch size (a start-up captures many)."""


@triton.jit
def _rotate_pairs(y, cos, sin, j):
    """Rotate the pairs on the last axis (size 2) of `y` by `cos/sin` (broadcast over that axis)."""
    even = tl.sum(tl.where(j == 0, y, 0.0), axis=-1, keep_dims=True)
    odd = tl.sum(tl.where(j == 1, y, 0.0), axis=-1, keep_dims=True)
    return tl.where(j == 0, even * cos - odd * sin, odd * cos + even * sin)


@triton.jit
def _normed(x, inv_rms, weight_ptr, channel, mask, NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """`x` (fp32) times `inv_rms` and the weight of its `channel`s; unchanged without `NORM`."""
    if NORM:
        if HAS_WEIGHT:
            weight = tl.load(weight_ptr + channel, mask=mask, other=0.0).to(tl.float32)
            x = weight * (x * inv_rms)
        else:
            x = x * inv_rms
    return x


@triton.jit(do_not_specialize=["num_rows"])  # one compile for every batch size
def _norm_rope_kernel(
    x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr,
    num_rows, heads, width, stride_xt, stride_xh, stride_cos, stride_sin, eps,
    NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HALF_ROPE: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF_ROPE: tl.constexpr,
):
    """`BLOCK_ROWS` rows (`token * heads + head`) per program: optional RMSNorm, then RoPE on the trailing
    `2 * HALF_ROPE` channels with the token's `cos/sin` row. The rope channels are a second, pair-shaped
    `[rows, pairs, 2]` tile, so the bulk of the row loads and stores as one contiguous vector."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = row < num_rows
    token = row // heads
    x_row = token * stride_xt + (row % heads) * stride_xh
    dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_W)[None, :]
    mask = row_ok[:, None] & (offs < width)
    x = tl.load(x_ptr + x_row[:, None] + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.full([BLOCK_ROWS], 1.0, tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / width + eps)
        if not HAS_WEIGHT:  # the reference multiplies in the activation dtype by the rounded scale
            inv_rms = inv_rms.to(dtype).to(tl.float32)
    y = _normed(x, inv_rms[:, None], weight_ptr, offs, offs < width, NORM, HAS_WEIGHT)
    rope_start = width - 2 * HALF_ROPE
    tl.store(out_ptr + row[:, None] * width + offs, y.to(dtype), mask=mask & (offs < rope_start))
    if HALF_ROPE > 0:
        pair = tl.arange(0, BLOCK_HALF_ROPE)[None, :, None]
        j = tl.arange(0, 2)[None, None, :]
        channel = rope_start + pair * 2 + j
        rope_mask = row_ok[:, None, None] & (pair < HALF_ROPE)
        x = tl.load(x_ptr + x_row[:, None, None] + channel, mask=rope_mask, other=0.0).to(tl.float32)
        y = _normed(x, inv_rms[:, None, None], weight_ptr, channel, rope_mask, NORM, HAS_WEIGHT)
        y = y.to(dtype).to(tl.float32)
        cos = tl.load(cos_ptr + token[:, None, None] * stride_cos + pair, mask=rope_mask, other=1.0)
        sin = tl.load(sin_ptr + token[:, None, None] * stride_sin + pair, mask=rope_mask, other=0.0)
        y = _rotate_pairs(y, cos, sin, j)
        tl.store(out_ptr + row[:, None, None] * width + channel, y.to(dtype), mask=rope_mask)


def _rows_per_program(num_rows: int, block_w: int, device: torch.device) -> int:
    """One row per program for small batches (parallelism), up to a 4K-element tile for big ones. Triton's
    interpreter (off the GPU) runs programs one by one, so there every program takes up to 32 rows."""
    if device.type != "cuda":
        return min(32, triton.next_power_of_2(num_rows))
    return 1 if num_rows < 4096 else max(1, min(8, 4096 // block_w))


def _launch_norm_rope(x, weight, eps, cos, sin, norm: bool, rows_per_program: int | None) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"expected x of shape [tokens, ..., width], got {tuple(x.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    num_tokens, width = x.shape[0], x.shape[-1]
    if x.numel() == 0:  # e.g. a step in which no compressed entry closes
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.reshape(num_tokens, -1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    heads = rows.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half_rope, stride_cos, stride_sin = 0, 0, 0
    if cos is not None:
        if cos.shape[0] != num_tokens or sin.shape != cos.shape or 2 * cos.shape[-1] > width:
            raise ValueError(
                f"cos/sin must be [tokens={num_tokens}, rope_dim // 2 <= {width // 2}], got "
                f"{tuple(cos.shape)} and {tuple(sin.shape)}"
            )
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        half_rope, stride_cos, stride_sin = cos.shape[-1], cos.stride(0), sin.stride(0)
    if weight is not None and weight.numel() != width:
        raise ValueError(f"norm weight has {weight.numel()} elements, expected {width}")
    num_rows, block_w = num_tokens * heads, triton.next_power_of_2(width)
    block_rows = rows_per_program or _rows_per_program(num_rows, block_w, x.device)
    _norm_rope_kernel[(triton.cdiv(num_rows, block_rows),)](
        rows, weight if weight is not None else rows, cos if cos is not None else rows,
        sin if sin is not None else rows, out,
        num_rows, heads, width, rows.stride(0), rows.stride(1), stride_cos, stride_sin, float(eps),
        NORM=norm, HAS_WEIGHT=weight is not None, HALF_ROPE=half_rope, BLOCK_W=block_w, BLOCK_ROWS=block_rows,
        BLOCK_HALF_ROPE=triton.next_power_of_2(max(half_rope, 1)),
        num_warps=max(1, min(8, block_rows * block_w // 256)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None, rows_per_program: int | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of `x` `[T, ..., W]` (`weight` fp32 `[W]`, None for unit), then, with
    `cos/sin` fp32 `[T, R/2]`, RoPE on the trailing `R` channels; one launch, returns a new tensor.
    `rows_per_program` fixes the tile (deterministic mode); None picks it from the row count."""
    return _launch_norm_rope(x, weight, eps, cos, sin, True, rows_per_program)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows_per_program: int | None = None) -> torch.Tensor:
    """RoPE on the trailing `2 * cos.shape[-1]` channels of `x` `[T, ..., W]`; returns a new tensor."""
    return _launch_norm_rope(x, None, 0.0, cos, sin, False, rows_per_program)


@triton.jit
def _request_of(query_start_loc_ptr, token, num_seqs, BLOCK_S: tl.constexpr):
    """Index of the request owning flat `token`: the count of request ends at or before it."""
    count = 0
    for first in range(0, num_seqs, BLOCK_S):
        seq = first + tl.arange(0, BLOCK_S)
        ends = tl.load(query_start_loc_ptr + 1 + seq, mask=seq < num_seqs, other=0)
        count += tl.sum(((ends <= token) & (seq < num_seqs)).to(tl.int32), axis=0)
    return count


@triton.jit
def _cos_sin(angle):
    """Accurate cos and sin for large fp32 angles: reduce by 2*pi (split in two fp32 parts) first."""
    turns = tl.floor(angle * 0.15915494309189535 + 0.5)
    reduced = tl.fma(turns, -6.2831854820251465, angle)
    reduced = tl.fma(turns, 1.7484556000744883e-07, reduced)
    return tl.cos(reduced), tl.sin(reduced)


@triton.jit
def _span_rows(
    kv_ptr, gate_ptr, stride_kv, stride_gate, bias_ptr, kv_tail_ptr, stride_kv_slot, stride_kv_row,
    gate_tail_ptr, stride_gate_slot, stride_gate_row, token, position, start, slot, r, channel,
    RATE: tl.constexpr, RING: tl.constexpr, WIDTH: tl.constexpr, PROJ: tl.constexpr, OVERLAP: tl.constexpr,
):
    """fp32 `kv` and biased `gate` of span rows `r` (broadcast against `channel`, entry channels) of the
    span ending at `position`: from this step's rows at or after `start`, else from the slot's tail ring.
    Rows past the span get a `-inf` gate."""
    SPAN: tl.constexpr = 2 * RATE if OVERLAP else RATE
    row_ok = r < SPAN
    channel_ok = channel < WIDTH
    row_pos = position - SPAN + 1 + r
    col = channel
    if OVERLAP:  # previous window: first WIDTH channels; current window: last WIDTH
        col = channel + tl.where(r >= RATE, WIDTH, 0)
    in_step = row_pos >= start
    step_mask = row_ok & in_step & channel_ok
    tail_mask = row_ok & (row_pos < start) & channel_ok
    step_row = token - SPAN + 1 + r
    kv_ring = slot * stride_kv_slot + (row_pos % RING) * stride_kv_row
    kv_new = tl.load(kv_ptr + step_row * stride_kv + col, mask=step_mask, other=0.0).to(tl.float32)
    kv_old = tl.load(kv_tail_ptr + kv_ring + col, mask=tail_mask, other=0.0).to(kv_ptr.dtype.element_ty)
    gate_new = tl.load(gate_ptr + step_row * stride_gate + col, mask=step_mask, other=0.0).to(tl.float32)
    gate_new += tl.load(bias_ptr + (row_pos % RATE) * PROJ + col, mask=step_mask, other=0.0)
    gate_ring = slot * stride_gate_slot + (row_pos % RING) * stride_gate_row
    gate_old = tl.load(gate_tail_ptr + gate_ring + col, mask=tail_mask, other=0.0).to(tl.float32)
    kv = tl.where(in_step, kv_new, kv_old.to(tl.float32))
    gate = tl.where(row_ok, tl.where(in_step, gate_new, gate_old), float("-inf"))
    return kv, gate


@triton.jit
def _softmax_pool_step(best, total, pooled, kv, gate):
    """One online-softmax step over axis 0 (rows) of `kv`/`gate` for running max, sum and weighted sum."""
    new_best = tl.maximum(best, tl.max(gate, axis=0))
    rescale = tl.exp(best - new_best)
    weight = tl.exp(gate - tl.expand_dims(new_best, 0))
    return new_best, total * rescale + tl.sum(weight, axis=0), pooled * rescale + tl.sum(weight * kv, axis=0)


@triton.jit
def _store_entry(pooled, entries_ptr, stride_entries, tables_ptr, stride_table, seq, entry, norm_weight_ptr,
                 inv_freq_ptr, rope_scaling, eps, dtype, RATE: tl.constexpr, WIDTH: tl.constexpr,
                 HALF_ROPE: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    """RMSNorm * weight of the pooled `[pairs, 2]` row, RoPE at position `entry * RATE`, and the store to
    the entry's paged row."""
    pair = tl.arange(0, BLOCK_PAIRS)[:, None]
    j = tl.arange(0, 2)[None, :]
    channel = pair * 2 + j
    valid = channel < WIDTH
    pooled = tl.where(valid, pooled, 0.0).to(dtype).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(tl.sum(pooled * pooled, axis=1), axis=0) / WIDTH + eps)
    norm_weight = tl.load(norm_weight_ptr + channel, mask=valid, other=0.0)
    closed = (norm_weight * (pooled * inv_rms)).to(dtype).to(tl.float32)
    k = pair - (WIDTH // 2 - HALF_ROPE)
    in_rope = (k >= 0) & (pair * 2 < WIDTH)
    angle = (entry * RATE).to(tl.float32) * tl.load(inv_freq_ptr + k, mask=in_rope, other=0.0)
    cos, sin = _cos_sin(angle)
    rotated = _rotate_pairs(closed, cos * rope_scaling, sin * rope_scaling, j)
    closed = tl.where(in_rope, rotated, closed).to(dtype)
    epb: tl.constexpr = 128 // RATE
    block = tl.load(tables_ptr + seq * stride_table + entry // epb)
    target = entries_ptr + (block * epb + entry % epb) * stride_entries + channel
    tl.store(target, closed.to(entries_ptr.dtype.element_ty), mask=valid)


@triton.jit(do_not_specialize=["num_seqs"])
def _close_kernel(
    kv_ptr, gate_ptr, stride_kv, stride_gate,
    positions_ptr, query_start_loc_ptr, start_positions_ptr, slots_ptr, tables_ptr, stride_table, no_write_ptr,
    bias_ptr, norm_weight_ptr, inv_freq_ptr, rope_scaling, eps,
    kv_tail_ptr, stride_kv_slot, stride_kv_row, gate_tail_ptr, stride_gate_slot, stride_gate_row,
    pooled_ptr, entries_ptr, stride_entries, num_seqs,
    RATE: tl.constexpr, RING: tl.constexpr, WIDTH: tl.constexpr, PROJ: tl.constexpr, OVERLAP: tl.constexpr,
    HALF_ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_PAIRS: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Grid `(tokens, channel blocks)`. A token at position `p` with `(p + 1) % RATE == 0` closes entry
    `(p + 1) // RATE - 1` of its request unless it is cached: an online softmax over `BLOCK_R`-row blocks
    of its span pools `2 * BLOCK_PAIRS` channels. Unsplit (one block), the program finishes and stores the
    entry; split, it leaves its channels in `pooled[token]` for `_finish_kernel`."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    if (position + 1) % RATE != 0:
        return
    entry = (position + 1) // RATE - 1
    seq = _request_of(query_start_loc_ptr, token, num_seqs, BLOCK_S)
    if (entry + 1) * RATE <= tl.load(no_write_ptr + seq):
        return
    start = tl.load(start_positions_ptr + seq)
    slot = tl.load(slots_ptr + seq)
    SPAN: tl.constexpr = 2 * RATE if OVERLAP else RATE
    first_row = 0
    if OVERLAP:  # entry 0 has no previous window
        first_row = tl.where(entry == 0, RATE, 0)
    # [rows, pairs, 2]: every program thread holds whole columns, so the row reductions stay in registers
    pair = tl.program_id(1) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)[None, :, None]
    channel = pair * 2 + tl.arange(0, 2)[None, None, :]
    best = tl.full([BLOCK_PAIRS, 2], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_PAIRS, 2], tl.float32)
    pooled = tl.zeros([BLOCK_PAIRS, 2], tl.float32)
    for row0 in range(first_row, SPAN, BLOCK_R):
        r = row0 + tl.arange(0, BLOCK_R)[:, None, None]
        kv, gate = _span_rows(
            kv_ptr, gate_ptr, stride_kv, stride_gate, bias_ptr, kv_tail_ptr, stride_kv_slot, stride_kv_row,
            gate_tail_ptr, stride_gate_slot, stride_gate_row, token, position, start, slot, r, channel,
            RATE, RING, WIDTH, PROJ, OVERLAP,
        )
        best, total, pooled = _softmax_pool_step(best, total, pooled, kv, gate)
    pooled = pooled / total
    if SPLIT:
        out = tl.program_id(1) * BLOCK_PAIRS * 2 + tl.arange(0, BLOCK_PAIRS)[:, None] * 2 + tl.arange(0, 2)[None, :]
        tl.store(pooled_ptr + token * WIDTH + out, pooled, mask=out < WIDTH)
    else:
        _store_entry(pooled, entries_ptr, stride_entries, tables_ptr, stride_table, seq, entry, norm_weight_ptr,
                     inv_freq_ptr, rope_scaling, eps, kv_ptr.dtype.element_ty, RATE, WIDTH, HALF_ROPE, BLOCK_PAIRS)


@triton.jit(do_not_specialize=["num_seqs"])
def _finish_kernel(
    kv_ptr, gate_ptr, stride_kv, stride_gate,
    positions_ptr, query_start_loc_ptr, slots_ptr, tables_ptr, stride_table, no_write_ptr,
    bias_ptr, norm_weight_ptr, inv_freq_ptr, rope_scaling, eps,
    kv_tail_ptr, stride_kv_slot, stride_kv_row, gate_tail_ptr, stride_gate_slot, stride_gate_row,
    pooled_ptr, entries_ptr, stride_entries, num_seqs,
    RATE: tl.constexpr, RING: tl.constexpr, WIDTH: tl.constexpr, PROJ: tl.constexpr, HALF_ROPE: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, FINISH: tl.constexpr,
):
    """One program per token, after `_close_kernel`. With `FINISH` (split pooling), a closing token
    finishes and stores its entry from `pooled[token]`. Then each request's last `RING` tokens store their
    kv and biased gate rows in the tail rings (which every close has read by now)."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    seq = _request_of(query_start_loc_ptr, token, num_seqs, BLOCK_S)
    if FINISH:
        entry = (position + 1) // RATE - 1
        if ((position + 1) % RATE == 0) & ((entry + 1) * RATE > tl.load(no_write_ptr + seq)):
            channel = tl.arange(0, BLOCK_PAIRS)[:, None] * 2 + tl.arange(0, 2)[None, :]
            pooled = tl.load(pooled_ptr + token * WIDTH + channel, mask=channel < WIDTH, other=0.0)
            _store_entry(pooled, entries_ptr, stride_entries, tables_ptr, stride_table, seq, entry,
                         norm_weight_ptr, inv_freq_ptr, rope_scaling, eps, kv_ptr.dtype.element_ty, RATE, WIDTH,
                         HALF_ROPE, BLOCK_PAIRS)
    if token >= tl.load(query_start_loc_ptr + seq + 1) - RING:
        slot = tl.load(slots_ptr + seq)
        offs = tl.arange(0, BLOCK_P)
        ok = offs < PROJ
        kv = tl.load(kv_ptr + token * stride_kv + offs, mask=ok)
        kv_row = kv_tail_ptr + slot * stride_kv_slot + (position % RING) * stride_kv_row
        tl.store(kv_row + offs, kv.to(kv_tail_ptr.dtype.element_ty), mask=ok)
        gate = tl.load(gate_ptr + token * stride_gate + offs, mask=ok).to(tl.float32)
        gate += tl.load(bias_ptr + (position % RATE) * PROJ + offs, mask=ok)
        gate_row = gate_tail_ptr + slot * stride_gate_slot + (position % RING) * stride_gate_row
        tl.store(gate_row + offs, gate.to(gate_tail_ptr.dtype.element_ty), mask=ok)


def _check_compress(kv, gate, w: CompressorWeights, kv_tail, gate_tail, entries) -> None:
    proj = 2 * w.width if w.overlap else w.width
    problems = []
    if 128 % w.rate:
        problems.append(f"rate {w.rate} must divide the 128-token cache block")
    if kv.dim() != 2 or kv.shape[1] != proj or gate.shape != kv.shape:
        problems.append(f"kv and gate must be [tokens, {proj}], got {tuple(kv.shape)} and {tuple(gate.shape)}")
    if kv_tail.dim() != 3 or kv_tail.shape[2] != proj or gate_tail.shape != kv_tail.shape:
        problems.append(f"kv_tail and gate_tail must be [slots, ring, {proj}], got {tuple(kv_tail.shape)} and "
                        f"{tuple(gate_tail.shape)}")
    if entries.dim() != 2 or entries.shape[1] != w.width:
        problems.append(f"entries must be [rows, {w.width}], got {tuple(entries.shape)}")
    if tuple(w.position_bias.shape) != (w.rate, proj) or 2 * w.inv_freq.numel() > w.width:
        problems.append(f"position_bias must be [{w.rate}, {proj}] and rope_dim <= {w.width}")
    if any(t.stride(-1) != 1 for t in (kv, gate, kv_tail, gate_tail, entries)):
        problems.append("kv, gate, the tails and entries need a contiguous last dim")
    if problems:
        raise ValueError("compress: " + "; ".join(problems))


def _channel_split(width: int, span: int, num_tokens: int) -> int:
    """Channels per pooling program, or 0 for one program per closing token that also finishes the entry.

    A long (HCA) span walked by one program is a chain of dependent row-block loads (~30 us for 128 rows
    of 512 channels), which a small step (decode) waits on; there several programs split the channels.
    In a big step the closing tokens already fill the GPU and the early-exit programs of a split grid
    would cost more."""
    return 32 if span > 16 and num_tokens * triton.cdiv(width, 32) <= 16384 else 0


def compress(kv: torch.Tensor, gate: torch.Tensor, weights: CompressorWeights, metadata: AttentionMetadata,
             kv_tail: torch.Tensor, gate_tail: torch.Tensor, entries: torch.Tensor, no_write_before: torch.Tensor,
             eps: float, channel_split: int | None = None) -> None:
    """Close the windows this step ends into `entries`, then refresh the tail rings (two launches).

    Semantics of `LayerOps.compress`; tokens that close nothing or whose entry is cached write nothing
    (the pool's scratch row is never touched). The second launch's ring write overwrites tail rows that
    the first launch's window close reads. `channel_split` fixes `_channel_split`'s choice (deterministic
    mode); None picks it from the step's size.
    """
    _check_compress(kv, gate, weights, kv_tail, gate_tail, entries)
    num_tokens = kv.shape[0]
    if num_tokens == 0:
        return
    w, ring, proj, meta = weights, kv_tail.shape[1], kv.shape[1], metadata
    num_seqs = meta.query_start_loc.shape[0] - 1
    span = 2 * w.rate if w.overlap else w.rate
    split = _channel_split(w.width, span, num_tokens) if channel_split is None else channel_split
    block_pairs = split // 2 if split else triton.next_power_of_2((w.width + 1) // 2)
    block_r = max(1, min(triton.next_power_of_2(span), _MAX_TILE // (2 * block_pairs)))
    # split pooling leaves each closing token's pooled row here for the finishing launch
    pooled = torch.empty(num_tokens, w.width, dtype=torch.float32, device=kv.device) if split else entries
    common = (kv, gate, kv.stride(0), gate.stride(0), meta.positions, meta.query_start_loc)
    rest = (
        meta.slots, meta.block_tables, meta.block_tables.stride(0), no_write_before,
        w.position_bias.float().contiguous(), w.norm_weight.float().contiguous(), w.inv_freq.float().contiguous(),
        float(w.rope_scaling), float(eps),
        kv_tail, kv_tail.stride(0), kv_tail.stride(1), gate_tail, gate_tail.stride(0), gate_tail.stride(1),
        pooled, entries, entries.stride(0), num_seqs,
    )
    _close_kernel[(num_tokens, triton.cdiv(w.width, 2 * block_pairs))](
        *common, meta.start_positions, *rest,
        RATE=w.rate, RING=ring, WIDTH=w.width, PROJ=proj, OVERLAP=w.overlap, HALF_ROPE=w.inv_freq.numel(),
        BLOCK_R=block_r, BLOCK_PAIRS=block_pairs, BLOCK_S=_REQUEST_SCAN, SPLIT=split > 0,
        num_warps=8 if block_r * block_pairs * 2 >= _MAX_TILE else 4,
    )
    _finish_kernel[(num_tokens,)](
        *common, *rest,
        RATE=w.rate, RING=ring, WIDTH=w.width, PROJ=proj, HALF_ROPE=w.inv_freq.numel(),
        BLOCK_PAIRS=triton.next_power_of_2((w.width + 1) // 2), BLOCK_P=triton.next_power_of_2(proj),
        BLOCK_S=_REQUEST_SCAN, FINISH=split > 0, num_warps=4,
    )


@triton.jit(do_not_specialize=["num_seqs"])
def _window_kernel(kv_ptr, stride_kv, positions_ptr, query_start_loc_ptr, slots_ptr, window_ptr, stride_slot,
                   stride_row, num_seqs, width, RING: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per token: each request's last `RING` tokens store their row at `[slot, pos % RING]`."""
    token = tl.program_id(0).to(tl.int64)
    seq = _request_of(query_start_loc_ptr, token, num_seqs, BLOCK_S)
    if token >= tl.load(query_start_loc_ptr + seq + 1) - RING:
        position = tl.load(positions_ptr + token)
        slot = tl.load(slots_ptr + seq)
        offs = tl.arange(0, BLOCK_W)
        row = tl.load(kv_ptr + token * stride_kv + offs, mask=offs < width)
        target = window_ptr + slot * stride_slot + (position % RING) * stride_row + offs
        tl.store(target, row.to(window_ptr.dtype.element_ty), mask=offs < width)


def write_ring(metadata: AttentionMetadata, ring: torch.Tensor, rows: torch.Tensor) -> None:
    """`LayerOps.write_window`: each request's last `ring.shape[1]` rows of the step to `ring[slot, pos % len]`,
    one launch, no host read (a long chunk's earlier rows are skipped, so no two rows share a target)."""
    if rows.dim() != 2 or ring.dim() != 3 or rows.shape[1] != ring.shape[2] or rows.stride(-1) != 1:
        raise ValueError(f"write_ring: rows [T, W] (contiguous last dim) into a ring [slots, len, W], got "
                         f"{tuple(rows.shape)} and {tuple(ring.shape)}")
    if ring.stride(-1) != 1:
        raise ValueError("write_ring: the ring needs a contiguous last dim")
    num_tokens = rows.shape[0]
    if num_tokens == 0:
        return
    num_seqs = metadata.query_start_loc.shape[0] - 1
    _window_kernel[(num_tokens,)](
        rows, rows.stride(0), metadata.positions, metadata.query_start_loc, metadata.slots, ring, ring.stride(0),
        ring.stride(1), num_seqs, rows.shape[1], RING=ring.shape[1],
        BLOCK_W=triton.next_power_of_2(rows.shape[1]),
        BLOCK_S=_REQUEST_SCAN, num_warps=4,
    )


@triton.jit
def fp32_linear_kernel(x_ptr, w_ptr, out_ptr, num_rows, n, k, stride_x, stride_w, stride_out,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`out[t, j] = sum_i x[t, i] * w[j, i]` in fp32, one program per (output tile, block of `BLOCK_T`
    rows): each weight tile is read once in its own dtype, widened in registers and multiplied with each
    real row in turn on CUDA cores (decode steps have a few rows, so tensor-core tiles would be padding).
    A row's sum runs in the same order whatever the other rows are."""
    pid_n, pid_t = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < n
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.minimum(num_rows - pid_t * BLOCK_T, BLOCK_T)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < k
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
                    mask=n_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
        for r in range(rows):
            x = tl.load(x_ptr + (pid_t * BLOCK_T + r).to(tl.int64) * stride_x + offs_k, mask=k_valid, other=0.0)
            dot = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
            acc += tl.where((tl.arange(0, BLOCK_T) == r)[:, None], dot[None, :], 0.0)
    out_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=(offs_t < num_rows)[:, None] & n_valid[None, :])


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`LayerOps.fp32_linear`: fp32 `x` `[T, K]` times `weight` `[N, K]` (any float dtype) transposed."""
    x = x.float().contiguous()
    weight = weight.contiguous()
    (num_rows, k), n = x.shape, weight.shape[0]
    out = torch.empty(num_rows, n, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return out
    block_t, block_n, block_k = 16, 32, 256
    grid = (triton.cdiv(n, block_n), triton.cdiv(num_rows, block_t))
    fp32_linear_kernel[grid](x, weight, out, num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
                             BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
