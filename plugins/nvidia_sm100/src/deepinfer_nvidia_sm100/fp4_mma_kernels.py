"""FP4 routed experts on tensor cores with bf16 activations (W4A16): the weights are the MMA's first operand.

Hopper has no FP4 MMA, so each packed e2m1 weight is widened to bf16 in registers before a bf16 MMA.
Where the widened tile sits decides the speed: as the MMA's second operand it must go through shared
memory, and every K step pays a register -> shared -> register round trip on top of the decode (the
`moe_kernels` FP4 tiles, 3.5x slower than bf16 at 16 tokens). As the *first* operand a Hopper `wgmma`
reads it from registers. So these kernels compute the transposed product, `out.T[n, t] = W[n, :] @
x[t, :].T`: weight rows (output features) are the MMA's M side, in tiles of `BLOCK_W` (64 or 128, a
`wgmma`'s natural height), and the block's token rows are its N side, in tiles of `BLOCK_T` (16 at decode:
one row in a tile of 16 costs the same weight traffic and decode as sixteen). The activations' tile
`[BLOCK_K, BLOCK_T]` goes through shared memory as a normal operand.

`DECODE` says how a tile is widened: 0 hands the packed bytes and their e8m0 exponents to
`tl.dot_scaled`, which Triton lowers on Hopper to a register-level e2m1 -> bf16 decode, one multiply by
the scale, and a `wgmma` whose first operand stays in registers; 1 decodes bytes with
`moe_kernels._fp4_halves` (the even and the odd input columns as two dots of half width); 2 reads 32-bit
words of eight codes and decodes two codes an integer operation (`fp4_gemv_kernels._half_codes`), then
multiplies eight column sets (inputs `8i + j`) by the activations' matching rows. All compute the same
product; the bench times them side by side.

Every launch is sized from the token count alone (CUDA graphs), both epilogues are those of the other
MoE kernels: the gate/up pair's clamped SwiGLU written per sorted slot, the down projection's rows scaled
by their routing weights and written at each row's original place.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_nvidia_sm100.fp4_gemv_kernels import _half_codes
from deepinfer_nvidia_sm100.moe_kernels import _fp4_halves, _tile, swiglu

DECODES = {"mma": 0, "mma_halves": 1, "mma_words": 2, "mma_pairs": 3}
"""`GemmConfig.kernel` -> the kernels' `DECODE`: `tl.dot_scaled`; bytes decoded into the even and odd
input columns (`moe_kernels._fp4_halves`); 32-bit words of eight codes decoded two codes an integer
operation (`fp4_gemv_kernels._half_codes`) into eight column sets; the same words widened straight to
bf16 pairs in inline PTX (`_paired_codes`)."""

CODES_PER_ELEMENT = {0: 2, 1: 2, 2: 8, 3: 8}
"""Codes a weight-tensor element holds under each `DECODE` (bytes, bytes, 32-bit words)."""


@triton.jit
def _activations_t(x_ptr, rows, row_valid, k0, k_size, stride_x, BLOCK_K: tl.constexpr, STEP: tl.constexpr,
                   FIRST: tl.constexpr):
    """The activations' tile, transposed: `[BLOCK_K // STEP, BLOCK_T]` inputs `k0 + FIRST + STEP * i` of
    the token rows `rows` (zero where a row or an input is out of range)."""
    offs_k = k0 + FIRST + STEP * tl.arange(0, BLOCK_K // STEP)
    ptrs = x_ptr + rows[None, :].to(tl.int64) * stride_x + offs_k[:, None]
    return tl.load(ptrs, mask=row_valid[None, :] & (offs_k < k_size)[:, None], other=0.0)


@triton.jit
def _scaled_words(w_ptrs, s_ptrs, w_valid, s_mask, k0, k_size, j: tl.constexpr, BLOCK_W: tl.constexpr,
                  BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Codes `j` and `j + 4` of a word tile (input columns `8i + j`, `8i + j + 4`), scaled, in `dtype`."""
    offs_q = tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptrs, mask=w_valid[:, None] & (k0 + 8 * offs_q < k_size)[None, :], other=0)
    exponents = tl.load(s_ptrs, mask=s_mask, other=0).to(tl.int32)
    factors = ((exponents + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127 + 14), s <= 240
    factors = tl.reshape(tl.broadcast_to(factors[:, :, None], (BLOCK_W, BLOCK_K // 32, 4)), (BLOCK_W, BLOCK_K // 8))
    low, high = _half_codes(words, j)
    return (low * factors).to(dtype), (high * factors).to(dtype)


@triton.jit
def _paired_codes(words, factors, j: tl.constexpr):
    """Codes `j` and `j + 4` of each word as bf16 values times their scales, in packed bf16x2 arithmetic: two
    shifts and one mask-merge put both codes' magnitude bits under a bf16's exponent and mantissa (bits
    6-8 and 22-24: the value times 2^-126; the subnormal `m / 2` lands on a bf16 subnormal) and their signs
    on bits 15 and 31; one `fma.rn.bf16x2` by `factors` (both halves the bf16 2^(s - 1), which folds the
    2^126 in: exact for scales up to 2^1, which FP4 experts never exceed) scales them; the pair is split
    into its halves."""
    if j == 0:
        shifts: tl.constexpr = "shl.b32 m, $2, 6; shl.b32 s, $2, 12;"
    elif j == 1:
        shifts: tl.constexpr = "shl.b32 m, $2, 2; shl.b32 s, $2, 8;"
    elif j == 2:
        shifts: tl.constexpr = "shr.u32 m, $2, 2; shl.b32 s, $2, 4;"
    else:
        shifts: tl.constexpr = "shr.u32 m, $2, 6; mov.b32 s, $2;"
    return tl.inline_asm_elementwise(
        "{ .reg .b32 m, s, p, z; " + shifts + " and.b32 m, m, 0x01C001C0; and.b32 s, s, 0x80008000; or.b32 p, m, s; "
        "mov.b32 z, 0x80008000; fma.rn.bf16x2 p, p, $3, z; mov.b32 {$0, $1}, p; }",
        "=h,=h,r,r", [words, factors], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _word_tile(w_ptrs, s_ptrs, w_valid, s_mask, k0, k_size, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile's 32-bit words `[BLOCK_W, BLOCK_K // 8]` and, for each word, its bf16x2 factor 2^(s - 1) twice."""
    offs_q = tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptrs, mask=w_valid[:, None] & (k0 + 8 * offs_q < k_size)[None, :], other=0)
    half = (tl.load(s_ptrs, mask=s_mask, other=0).to(tl.int32) + 126) << 7
    factors = tl.reshape(tl.broadcast_to((half | (half << 16))[:, :, None], (BLOCK_W, BLOCK_K // 32, 4)),
                         (BLOCK_W, BLOCK_K // 8))
    return words, factors


@triton.jit
def _fp4_step(acc_a, acc_b, a_ptrs, as_ptrs, b_ptrs, bs_ptrs, w_valid, x_ptr, rows, row_valid, k0, k_size,
              stride_x, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, TWO: tl.constexpr):
    """One K step of `acc_a += A_tile @ x_tile.T` and, with `TWO`, `acc_b += B_tile @ x_tile.T` on the same
    activations (loaded once): `*_ptrs` over a tile's packed elements `[BLOCK_W, BLOCK_K //
    CODES_PER_ELEMENT[DECODE]]`, `*s_ptrs` over its e8m0 exponents `[BLOCK_W, BLOCK_K // 32]`."""
    dtype = x_ptr.dtype.element_ty
    offs_s = tl.arange(0, BLOCK_K // 32)
    s_mask = w_valid[:, None] & (k0 + 32 * offs_s < k_size)[None, :]
    offs_h = tl.arange(0, BLOCK_K // 2)
    h_mask = w_valid[:, None] & (k0 + 2 * offs_h < k_size)[None, :]
    if DECODE == 0:
        x_t = _activations_t(x_ptr, rows, row_valid, k0, k_size, stride_x, BLOCK_K, 1, 0)
        codes = tl.load(a_ptrs, mask=h_mask, other=0)
        acc_a = tl.dot_scaled(codes, tl.load(as_ptrs, mask=s_mask, other=0), "e2m1", x_t, None, "bf16", acc_a,
                              fast_math=True)
        if TWO:
            codes = tl.load(b_ptrs, mask=h_mask, other=0)
            acc_b = tl.dot_scaled(codes, tl.load(bs_ptrs, mask=s_mask, other=0), "e2m1", x_t, None, "bf16", acc_b,
                                  fast_math=True)
    elif DECODE == 1:
        x_even = _activations_t(x_ptr, rows, row_valid, k0, k_size, stride_x, BLOCK_K, 2, 0)
        x_odd = _activations_t(x_ptr, rows, row_valid, k0, k_size, stride_x, BLOCK_K, 2, 1)
        even, odd = _fp4_halves(a_ptrs, as_ptrs, h_mask, s_mask, BLOCK_W, BLOCK_K, dtype)
        acc_a = tl.dot(odd, x_odd, tl.dot(even, x_even, acc_a))
        if TWO:
            even, odd = _fp4_halves(b_ptrs, bs_ptrs, h_mask, s_mask, BLOCK_W, BLOCK_K, dtype)
            acc_b = tl.dot(odd, x_odd, tl.dot(even, x_even, acc_b))
    elif DECODE == 3:
        a_words, a_factors = _word_tile(a_ptrs, as_ptrs, w_valid, s_mask, k0, k_size, BLOCK_W, BLOCK_K)
        if TWO:
            b_words, b_factors = _word_tile(b_ptrs, bs_ptrs, w_valid, s_mask, k0, k_size, BLOCK_W, BLOCK_K)
        for j in tl.static_range(4):
            x_low = _activations_t(x_ptr, rows, row_valid, k0, k_size, stride_x, BLOCK_K, 8, j)
            x_high = _activations_t(x_ptr, rows, row_valid, k0, k_size, stride_x, BLOCK_K, 8, j + 4)
            low, high = _paired_codes(a_words, a_factors, j)
            acc_a = tl.dot(high, x_high, tl.dot(low, x_low, acc_a))
            if TWO:
                low, high = _paired_codes(b_words, b_factors, j)
                acc_b = tl.dot(high, x_high, tl.dot(low, x_low, acc_b))
    else:
        for j in tl.static_range(4):
            x_low = _activations_t(x_ptr, rows, row_valid, k0, k_size, stride_x, BLOCK_K, 8, j)
            x_high = _activations_t(x_ptr, rows, row_valid, k0, k_size, stride_x, BLOCK_K, 8, j + 4)
            low, high = _scaled_words(a_ptrs, as_ptrs, w_valid, s_mask, k0, k_size, j, BLOCK_W, BLOCK_K, dtype)
            acc_a = tl.dot(high, x_high, tl.dot(low, x_low, acc_a))
            if TWO:
                low, high = _scaled_words(b_ptrs, bs_ptrs, w_valid, s_mask, k0, k_size, j, BLOCK_W, BLOCK_K, dtype)
                acc_b = tl.dot(high, x_high, tl.dot(low, x_low, acc_b))
    return acc_a, acc_b


@triton.jit
def _program(block_expert_ptr, sorted_rows_ptr, w_ptr, s_ptr, num_rows, out_features, stride_we, stride_wn, stride_se,
             stride_sn, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, CODES: tl.constexpr,
             N_FASTEST: tl.constexpr):
    """This program's expert (-1: an unused block), its slots, their rows and validity, its `BLOCK_W`
    weight rows and their validity, and pointers to their first K step's packed elements and exponents."""
    pid_t, pid_w = _tile(N_FASTEST)
    expert = tl.load(block_expert_ptr + pid_t)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.load(sorted_rows_ptr + offs_t)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    first = expert.to(tl.int64)
    w_ptrs = (w_ptr + first * stride_we + offs_w[:, None].to(tl.int64) * stride_wn
              + tl.arange(0, BLOCK_K // CODES)[None, :])
    s_ptrs = (s_ptr + first * stride_se + offs_w[:, None].to(tl.int64) * stride_sn
              + tl.arange(0, BLOCK_K // 32)[None, :])
    return expert, offs_t, rows, rows < num_rows, offs_w, offs_w < out_features, w_ptrs, s_ptrs


@triton.jit
def fp4_mma_gate_up_kernel(
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
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    N_FASTEST: tl.constexpr,
    DECODE: tl.constexpr,
    CODES: tl.constexpr,
):
    """`act[slot, n] = silu(min(g, limit)) * clamp(u, -limit, limit)` with `g, u = gate_up[e] @ x[token]`,
    one program per (row block, `BLOCK_W` gate columns and the matching up columns)."""
    expert, offs_t, rows, row_valid, offs_w, w_valid, g_ptrs, gs_ptrs = _program(
        block_expert_ptr, sorted_rows_ptr, w_ptr, s_ptr, num_rows, inter, stride_we, stride_wn, stride_se, stride_sn,
        BLOCK_T, BLOCK_W, BLOCK_K, CODES, N_FASTEST)
    if expert < 0:
        return
    tokens = tl.where(row_valid, rows // TOP_K, 0)
    u_ptrs, us_ptrs = g_ptrs + inter * stride_wn, gs_ptrs + inter * stride_sn
    acc_g = tl.zeros([BLOCK_W, BLOCK_T], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_W, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        acc_g, acc_u = _fp4_step(acc_g, acc_u, g_ptrs, gs_ptrs, u_ptrs, us_ptrs, w_valid, x_ptr, tokens, row_valid,
                                 k0, hidden, stride_x, BLOCK_W, BLOCK_K, DECODE, True)
        g_ptrs += BLOCK_K // CODES
        u_ptrs += BLOCK_K // CODES
        gs_ptrs += BLOCK_K // 32
        us_ptrs += BLOCK_K // 32
    act = swiglu(acc_g, acc_u, swiglu_limit, HAS_LIMIT)  # transposed: slots along the columns
    act_ptrs = act_ptr + offs_t[None, :].to(tl.int64) * stride_act + offs_w[:, None]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=w_valid[:, None])


@triton.jit
def fp4_mma_down_kernel(
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
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    N_FASTEST: tl.constexpr,
    DECODE: tl.constexpr,
    CODES: tl.constexpr,
):
    """`out[row, n] = weight[row] * (down[e] @ act[slot])[n]`, written at the row's original place."""
    expert, offs_t, rows, row_valid, offs_w, w_valid, w_ptrs, s_ptrs = _program(
        block_expert_ptr, sorted_rows_ptr, w_ptr, s_ptr, num_rows, hidden, stride_we, stride_wn, stride_se, stride_sn,
        BLOCK_T, BLOCK_W, BLOCK_K, CODES, N_FASTEST)
    if expert < 0:
        return
    acc = tl.zeros([BLOCK_W, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        acc, _ = _fp4_step(acc, acc, w_ptrs, s_ptrs, w_ptrs, s_ptrs, w_valid, act_ptr, offs_t, row_valid, k0, inter,
                           stride_act, BLOCK_W, BLOCK_K, DECODE, False)
        w_ptrs += BLOCK_K // CODES
        s_ptrs += BLOCK_K // 32
    weights = tl.load(row_weights_ptr + rows, mask=row_valid, other=0.0)
    acc = acc * weights[None, :]
    safe_rows = tl.where(row_valid, rows, 0).to(tl.int64)
    out_ptrs = out_ptr + safe_rows[None, :] * stride_out + offs_w[:, None]
    tl.store(out_ptrs, acc, mask=row_valid[None, :] & w_valid[:, None])
