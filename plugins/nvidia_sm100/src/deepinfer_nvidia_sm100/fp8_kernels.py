"""Triton kernels of the FP8 projections: per-token-group activation quantisation and a block-scaled GEMM.

`act_quant_kernel` turns activations `x[M, K]` into float8_e4m3fn `q` and one float32 scale per token and
`GROUP` (128) inputs, `x ~= q * scale`: `scale = amax / 448` (a power of two, rounded up, with UE8M0),
`q = round_to_nearest_even(x / scale)` with saturation. The rounding to the e4m3 grid is done on the
float32 bits before the cast, so the cast itself is exact on every backend (Triton's interpreter rounds
some values wrongly when it converts), which makes the result equal to torch's cast of the same values.

`fp8_gemm_kernel` computes `out[M, N] = (q * xs) @ (w * ws).T` on tiles of `[BLOCK_M, BLOCK_K] x
[BLOCK_K, BLOCK_N]`: both operands stay float8 in the `tl.dot` (wgmma on Hopper), and each K step's
fp32 partial product is multiplied by the activation scales of its rows and the weight scales of its
columns before it is added to the fp32 accumulator. `BLOCK_K` divides both the activation group and the
weight tile's columns (128 for V4's 128x128 tiles, 32 for V4.1's 32x32), so one scale covers a step.
`G > 1` runs a block-diagonal (grouped) projection: group g reads inputs `g * K ...` and writes outputs
`g * N ...` (rows of the weight). `SPLIT_K > 1` (small batches: more programs than output tiles) has
each program add up a slice of K and store its partial into `partial[split]`; `split_k_sum_kernel`
adds the slices in order (deterministic) and casts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_nvidia_sm100.platform import FP8_ACT_GROUP as ACT_GROUP  # noqa: F401 - re-exported


@triton.jit
def _round_to_e4m3(v):
    """`v` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, as float32: 3 mantissa bits for
    normal values (>= 2^-6), steps of 2^-9 below."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125  # round-half-even by the fp32 add
    rounded = tl.where(a < 0.015625, subnormal, normal)
    return tl.where(v < 0, -rounded, rounded)


@triton.jit
def _pow2_ceil(s):
    """The smallest power of two >= `s` (`s` positive, normal), from its float32 bits."""
    bits = s.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    stride_q,
    stride_s,
    GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
):
    """One program per (token, group of `GROUP` inputs): its scale and its float8 values."""
    row, group = tl.program_id(0), tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    valid = offs < K
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=valid, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30)
    scale = tl.math.div_rn(amax, 448.0)  # IEEE division (plain `/` is approximate on the GPU)
    if UE8M0:
        scale = _pow2_ceil(scale)
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    q = _round_to_e4m3(v)
    tl.store(q_ptr + row.to(tl.int64) * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=valid)
    tl.store(s_ptr + row.to(tl.int64) * stride_s + group, scale)


@triton.jit(do_not_specialize=["M"])  # one compile for every token count of a tile size
def fp8_gemm_kernel(
    q_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_q,
    stride_xs,
    stride_w,
    stride_ws,
    stride_out_split,
    stride_out,
    G: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """`out[m, g * N + n] = sum_k q[m, g * K + k] xs[m, .] * w[g * N + n, k] ws[., .]` over this
    program's K slice (`N`, `K`: one group's sizes)."""
    pid_n, pid_m, pid_gs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, split = pid_gs // SPLIT_K, pid_gs % SPLIT_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid, n_valid = offs_m < M, offs_n < N
    rows_w = g * N + offs_n  # rows of the whole weight, and columns of the whole output
    offs_k = tl.arange(0, BLOCK_K)
    num_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(num_steps, SPLIT_K)
    first, last = split * steps_per_split, tl.minimum((split + 1) * steps_per_split, num_steps)
    q_rows = q_ptr + offs_m[:, None].to(tl.int64) * stride_q + g * K
    w_rows = w_ptr + rows_w[:, None].to(tl.int64) * stride_w
    xs_rows = xs_ptr + offs_m.to(tl.int64) * stride_xs + (g * K) // GROUP
    ws_rows = ws_ptr + (rows_w // BLOCK_ROWS).to(tl.int64) * stride_ws
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(first, last):
        k0 = step * BLOCK_K
        k_valid = (k0 + offs_k) < K
        q = tl.load(q_rows + k0 + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_rows + k0 + offs_k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        xs = tl.load(xs_rows + k0 // GROUP, mask=m_valid, other=0.0)
        ws = tl.load(ws_rows + k0 // BLOCK_COLS, mask=n_valid, other=0.0)
        acc += tl.dot(q, tl.trans(w)) * xs[:, None] * ws[None, :]
    out_ptrs = (out_ptr + split * stride_out_split + offs_m[:, None].to(tl.int64) * stride_out
                + rows_w[None, :])
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@triton.jit  # numel = tokens x out_features, a multiple of 16 for every batch: one variant, aligned loads
def split_k_sum_kernel(partial_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """`out = sum(partial[split] for split in order)`, cast to `out`'s dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + split * numel + offs, mask=valid, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=valid)
