"""FP4 routed experts at decode sizes: the two grouped GEMMs as matrix-vector products on CUDA cores.

At decode an expert sees one or two rows, so a tensor-core tile of 16 rows is mostly padding, and on
Hopper (no FP4 MMA) each FP4 weight must be widened to bf16 and moved into the MMA's operand layout
before it can be multiplied: that widening, not HBM, bounds the tiled kernels. These kernels skip the
MMA: each program loads its `[BLOCK_N, BLOCK_K]` weight tile once per K step, packed, and for each of
its block's real rows in turn (a loop over the rows the block holds, not over `BLOCK_M`) decodes it in
the layout it was loaded in and multiplies, adding along K in registers.

The weights are read as 32-bit words of eight codes (input columns `8i .. 8i + 7`, low nibble
first). One shift-and-mask over a word decodes two codes at once, one per 16-bit half: shifting the word
left by `9 - 4j` (right by 3 for `j = 3`) and by `12 - 4j` and keeping bits `0x0E000E00` of the first and `0x80008000` of the
second gives, in its low half, the float16 bits of code `j` (exponent field 0 the subnormal `m / 2`, as
in e2m1) times 2^-14 and, in its high half, those of code `j + 4`. So eight codes cost about twelve
integer operations and eight conversions to fp32, where a byte at a time cost about forty: the integer
pipe, at half the rate of fp32 FMAs on Hopper, not HBM, is what bounds these kernels. The e8m0 scale `s`
becomes the factor 2^(s - 127 + 14), applied once per 32 inputs to the partial sums rather than to each
weight. Rows' partial sums are kept in fp32; the result matches the tiled kernels up to the order of
additions.

`fp4_dequant_kernel` writes whole experts' weights in the activations' dtype (the tiled kernels' decode,
`moe_kernels._fp4_halves`), for steps with many rows an expert (prefill), which then run the dense
tiled kernels on them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.moe_kernels import _fp4_halves, store_swiglu, store_weighted


@triton.jit
def _half_codes(words, j: tl.constexpr):
    """Codes `j` and `j + 4` of each word as fp32 values times 2^-14 (see the module's docstring)."""
    if j < 3:
        magnitudes = words << (9 - 4 * j)
    else:
        magnitudes = words >> 3
    pair = (magnitudes & 0x0E000E00) | ((words << (12 - 4 * j)) & -0x7FFF8000)  # -0x7FFF8000 is 0x80008000
    low = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _tile(w_ptrs, s_ptrs, w_mask, s_mask):
    """A packed tile `[BLOCK_N, BLOCK_K // 8]` of int32 words and its scale factors `[BLOCK_N, BLOCK_K //
    32]` (times 2^14). The words stay packed in registers and `_row_dot` decodes them for each row: at
    decode a block holds one or two rows, and eight times fewer registers a tile leave room to overlap
    the next tile's loads."""
    words = tl.load(w_ptrs, mask=w_mask, other=0)
    exponents = tl.load(s_ptrs, mask=s_mask, other=0).to(tl.int32)
    factors = ((exponents + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127 + 14); s <= 240 in practice
    return words, factors


@triton.jit
def _row_dot(words, factors, x_row, valid, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`[BLOCK_N]` sums over a word tile's weights times one row's inputs (`x_row` at the tile's first
    input, `valid` its words' mask), each 32-input group's sum scaled."""
    x_row += 8 * tl.arange(0, BLOCK_K // 8)
    products = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    for j in tl.static_range(4):
        low, high = _half_codes(words, j)
        products += low * tl.load(x_row + j, mask=valid, other=0.0).to(tl.float32)[None, :]
        products += high * tl.load(x_row + j + 4, mask=valid, other=0.0).to(tl.float32)[None, :]
    groups = tl.sum(tl.reshape(products, (BLOCK_N, BLOCK_K // 32, 4)), axis=2)
    return tl.sum(groups * factors, axis=1)


@triton.jit
def fp4_gate_up_gemv_kernel(
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
):
    """`moe_kernels.gate_up_kernel` for FP4 experts, one program per (row block, output tile)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + offs_m)
    count = tl.sum((rows < num_rows).to(tl.int32), axis=0)  # an expert's rows come first in its block
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < inter
    offs_w, offs_s = tl.arange(0, BLOCK_K // 8), tl.arange(0, BLOCK_K // 32)
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_w[None, :]
    gs_ptrs = s_ptr + expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn + offs_s[None, :]
    u_ptrs, us_ptrs = g_ptrs + inter * stride_wn, gs_ptrs + inter * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        w_valid = (k0 + 8 * offs_w) < hidden
        w_mask = n_valid[:, None] & w_valid[None, :]
        s_mask = n_valid[:, None] & ((k0 + 32 * offs_s) < hidden)[None, :]
        g_words, g_factors = _tile(g_ptrs, gs_ptrs, w_mask, s_mask)
        u_words, u_factors = _tile(u_ptrs, us_ptrs, w_mask, s_mask)
        for r in range(count):
            token = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + r) // TOP_K
            x_row = x_ptr + token.to(tl.int64) * stride_x + k0
            here = (tl.arange(0, BLOCK_M) == r)[:, None]
            acc_g += tl.where(here, _row_dot(g_words, g_factors, x_row, w_valid, BLOCK_N, BLOCK_K)[None, :], 0.0)
            acc_u += tl.where(here, _row_dot(u_words, u_factors, x_row, w_valid, BLOCK_N, BLOCK_K)[None, :], 0.0)
        g_ptrs += BLOCK_K // 8
        u_ptrs += BLOCK_K // 8
        gs_ptrs += BLOCK_K // 32
        us_ptrs += BLOCK_K // 32
    store_swiglu(acc_g, acc_u, act_ptr, offs_m, offs_n, n_valid, stride_act, swiglu_limit, HAS_LIMIT)


@triton.jit
def fp4_down_gemv_kernel(
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
):
    """`moe_kernels.down_kernel` for FP4 experts, one program per (row block, output tile)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + offs_m)
    row_valid = rows < num_rows
    count = tl.sum(row_valid.to(tl.int32), axis=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hidden
    offs_w, offs_s = tl.arange(0, BLOCK_K // 8), tl.arange(0, BLOCK_K // 32)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_w[None, :]
    s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn + offs_s[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        w_valid = (k0 + 8 * offs_w) < inter
        s_mask = n_valid[:, None] & ((k0 + 32 * offs_s) < inter)[None, :]
        words, factors = _tile(w_ptrs, s_ptrs, n_valid[:, None] & w_valid[None, :], s_mask)
        for r in range(count):
            a_row = act_ptr + (pid_m * BLOCK_M + r).to(tl.int64) * stride_act + k0
            here = (tl.arange(0, BLOCK_M) == r)[:, None]
            acc += tl.where(here, _row_dot(words, factors, a_row, w_valid, BLOCK_N, BLOCK_K)[None, :], 0.0)
        w_ptrs += BLOCK_K // 8
        s_ptrs += BLOCK_K // 32
    store_weighted(acc, out_ptr, rows, row_valid, row_weights_ptr, offs_n, n_valid, stride_out)


@triton.jit
def fp4_dequant_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    rows,
    cols,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_oe,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """`out[e, n, k]` = the FP4 weight's value, one program per (expert, row tile, column tile)."""
    expert, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    offs_s = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    n_valid = (offs_n < rows)[:, None]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_h[None, :]
    s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + offs_n[:, None].to(tl.int64) * stride_sn + offs_s[None, :]
    even, odd = _fp4_halves(w_ptrs, s_ptrs, n_valid & (2 * offs_h < cols)[None, :],
                            n_valid & (32 * offs_s < cols)[None, :], BLOCK_N, BLOCK_K, out_ptr.dtype.element_ty)
    values = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :]
    tl.store(out_ptrs, values.to(out_ptr.dtype.element_ty), mask=n_valid & (offs_k < cols)[None, :])


def dequantize_experts(packed, scales, dtype):
    """`[E, N, K]` values in `dtype` of packed FP4 experts `[E, N, K / 2]` with e8m0 exponents
    `[E, N, K / 32]` (uint8)."""
    num_experts, rows, half = packed.shape
    out = torch.empty(num_experts, rows, 2 * half, dtype=dtype, device=packed.device)
    block_n, block_k = 32, 256
    grid = (num_experts, triton.cdiv(rows, block_n), triton.cdiv(2 * half, block_k))
    fp4_dequant_kernel[grid](packed, scales, out, rows, 2 * half, packed.stride(0), packed.stride(1),
                             scales.stride(0), scales.stride(1), out.stride(0), out.stride(1),
                             BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def gemv_grid(num_blocks: int, num_cols: int, block_n: int) -> tuple[int, int]:
    """Row blocks first, output tiles second (CUDA allows 2^31 - 1 programs along the first axis)."""
    return num_blocks, triton.cdiv(num_cols, block_n)
