"""Triton kernels of the mHC block boundaries: `hc_pre`, `hc_post_pre` and `hc_post_head`, one launch each.

The grid is token blocks x splits of the hidden dim. Phase 1, per program and its slice of `D`: fold the
block output into the new streams (`post[j] * out + sum_i comb[i, j] * old[i]`, rounded to the stream dtype
and stored) and accumulate, per token, the slice's sum of squares and its dot products with every `fn` row.
With one split the program goes straight on; otherwise it stores its partial sums and bumps its block's
arrival counter, and the block's last program to arrive adds the partials up (in split order, so results do
not depend on arrival order) and goes on. Phase 2, in registers: the mixing weights (sigmoid, softmax,
Sinkhorn). Phase 3: the collapse `sum_i pre[i] * stream[i]`, stored; phase 4: its weighted RMSNorm in place.
V4.1's single pass (`single_pass.py`) collapses with a given `pre` instead (`GIVEN_PRE`) and keeps phase 2's.

Splitting `D` spreads decode's read of `fn` (1.5 MB at V4-Flash, fp32) over the GPU instead of one SM.
From `TWO_PASS_MIN_ROWS` rows on (prefill) a call takes two launches: `hyper_kernel` runs phase 1 over
`D` splits and stores the partial sums, taking the `fn` dot on tensor cores as three bf16 products
(`_dot_bf16x3`, exact for bf16 streams); `hyper_tail_kernel` then adds the partials up and runs phases 2-4
for a few tokens a program, so no program is left to collapse a block of 64 tokens alone.
The `fn` rows land in the accumulator's columns as a `[C // NP, NP]` grid (`NP = next_pow2(n)`): row 0 holds
`pre`, row 1 `post`, rows `2 + i` hold `comb[i, :]`, so the Sinkhorn runs on a masked slice of it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer_core.backends.layer_ops import HyperWeights, LayerOpsSpec

BLOCK_TOKENS = ((32, 1), (1024, 16))
"""`(up to this many tokens, tokens per program)`; 64 beyond. More tokens a program read `fn` fewer times;
fewer leave the last program of a block less of the collapse to do alone. (H200, 8,192 tokens, V4-Flash
sizes: 2.66 ms a call at 16 tokens a program, 1.60 ms at 64; 2,048 tokens: 0.69 / 0.51 ms.)"""
TWO_PASS_MIN_ROWS = 1024
"""From this many rows on a call runs in two launches (`LaunchPlan.two_pass`)."""
TAIL_TOKENS = 4
"""Rows a program of the two-pass path's second launch."""
TWO_PASS_TILE = (32, 4, 8)
"""The two-pass path's first launch: hidden channels a step (`BD`), warps, programs an SM it aims for.
(H200, V4-Flash sizes, `hc_post_pre`: 8,192 tokens 0.745 ms, 2,048 tokens 0.210 ms; 64 channels, 8
warps, 4 an SM: 1.07 / 0.31 ms; one launch with the fp32 dot, as before: 1.60 / 0.51 ms.)"""
TENSOR_CORE_DOT = True
"""The two-pass path takes the `fn` dot on tensor cores (`_dot_bf16x3`) when the streams are bf16."""
MAX_SPLIT_BLOCKS = 256
"""Token blocks a split launch may have: the size of the arrival-counter buffer."""


def new_split_counters(device: torch.device | str) -> torch.Tensor:
    """The zeroed arrival counters a split launch needs; every launch leaves them zeroed again.

    Make one per device before capturing CUDA graphs and pass it as `counters=` to every call on that
    device's stream (without it each split launch allocates and zeroes its own, one extra memset).
    """
    return torch.zeros(MAX_SPLIT_BLOCKS, dtype=torch.int32, device=device)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 `x` rounded to `dtype`, to nearest even. bf16 rounds through its bits: Triton's interpreter
    truncates in `.to(tl.bfloat16)`, and this gives the compiled cast's results everywhere."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _dot_bf16x3(a, w, acc, EMULATE: tl.constexpr):
    """`acc + a @ w` for bf16-valued fp32 `a` and fp32 `w` on tensor cores: `w` split into three bf16
    parts (8 significant bits each, 24 in all) whose products with `a` are exact in fp32, so the result
    is fp32's up to summation order. `EMULATE` (Triton's interpreter, whose bf16 `tl.dot` is broken)
    multiplies the same bf16 values in fp32."""
    a16 = a.to(tl.bfloat16)
    hi = w.to(tl.bfloat16)
    rest = w - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    if EMULATE:
        a32 = a16.to(tl.float32)
        acc = tl.dot(a32, lo.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(a32, mid.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a32, hi.to(tl.float32), acc, input_precision="ieee")
    acc = tl.dot(a16, lo, acc)
    acc = tl.dot(a16, mid, acc)
    return tl.dot(a16, hi, acc)


@triton.jit
def _combine_partials(part_m_ptr, part_sq_ptr, rows, num_splits, padded, BT: tl.constexpr, C: tl.constexpr,
                      SG: tl.constexpr):
    """The block's dot products and sums of squares: its splits' partials, added in a fixed order."""
    s = tl.arange(0, SG)
    c = tl.arange(0, C)
    acc = tl.zeros([BT, C], dtype=tl.float32)
    sumsq = tl.zeros([BT], dtype=tl.float32)
    for s0 in range(0, num_splits, SG):
        at = (s0 + s)[:, None] * padded + rows[None, :]
        ok = ((s0 + s) < num_splits)[:, None]
        acc += tl.sum(tl.load(part_m_ptr + at[:, :, None] * C + c[None, None, :], mask=ok[:, :, None],
                              other=0.0, cache_modifier=".cg"), axis=0)
        sumsq += tl.sum(tl.load(part_sq_ptr + at, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
    return acc, sumsq


@triton.jit
def _mixing_weights(acc, sumsq, rows, live, base_ptr, scale_ptr, post_ptr, comb_ptr, pre_ptr, hidden, hc_eps,
                    rms_eps, N: tl.constexpr, NP: tl.constexpr, C: tl.constexpr, BT: tl.constexpr,
                    SINKHORN_ITERS: tl.constexpr, IS_HEAD: tl.constexpr):
    """Phase 2: `pre` (to `pre_ptr`, `[BT, NP]` scratch), `post` and the Sinkhorn-normalised `comb`."""
    m = tl.reshape(acc * tl.rsqrt(sumsq / (N * hidden) + rms_eps)[:, None], [BT, C // NP, NP])
    q = tl.arange(0, C // NP)[None, :, None]
    j = tl.arange(0, NP)
    jj = j[None, None, :]
    j_ok = j < N
    pre = tl.sum(tl.where(q == 0, m, 0.0), axis=1)
    pre_base = tl.load(base_ptr + j, mask=j_ok, other=0.0)
    pre = tl.sigmoid(pre * tl.load(scale_ptr) + pre_base[None, :]) + hc_eps
    tl.store(pre_ptr + rows[:, None] * NP + j[None, :], pre)
    if not IS_HEAD:
        post = tl.sum(tl.where(q == 1, m, 0.0), axis=1)
        post_base = tl.load(base_ptr + N + j, mask=j_ok, other=0.0)
        post = 2.0 * tl.sigmoid(post * tl.load(scale_ptr + 1) + post_base[None, :])
        tl.store(post_ptr + rows[:, None] * N + j[None, :], post, mask=live[:, None] & j_ok[None, :])
        is_comb = (q >= 2) & (q < 2 + N) & (jj < N)
        comb_at = (q - 2) * N + jj
        logits = m * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + comb_at, mask=is_comb, other=0.0)
        # -1e30, not -inf: rows outside the comb block must not turn into NaN (they are zeroed below)
        logits = tl.where(is_comb, logits, -1e30)
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        comb = tl.where(is_comb, e / tl.sum(e, axis=2)[:, :, None] + hc_eps, 0.0)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        for _ in range(SINKHORN_ITERS - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + rows[:, None, None] * (N * N) + comb_at, comb, mask=live[:, None, None] & is_comb)
    return pre


@triton.jit
def _collapse_norm(rows, live, src_ptr, src_st, src_sn, src_sd, pre_ptr, pre_st, norm_w_ptr, x_ptr, hidden,
                   rms_eps, N: tl.constexpr, BT: tl.constexpr, TAIL_D: tl.constexpr):
    """Phases 3-4: `x = sum_i pre[i] * stream[i]` rounded to the stream dtype, then its weighted RMSNorm
    (`pre` rows `pre_st` apart: the scratch of phase 2, or the caller's `collapse_pre`)."""
    dtype = x_ptr.dtype.element_ty
    d = tl.arange(0, TAIL_D)
    x_sq = tl.zeros([BT, TAIL_D], dtype=tl.float32)
    for d0 in range(0, hidden, TAIL_D):
        dd = d0 + d
        ok = live[:, None] & (dd < hidden)[None, :]
        x = tl.zeros([BT, TAIL_D], dtype=tl.float32)
        for i in tl.static_range(N):
            stream = tl.load(src_ptr + rows[:, None] * src_st + i * src_sn + dd[None, :] * src_sd, mask=ok,
                             other=0.0, cache_modifier=".cg")
            x += tl.load(pre_ptr + rows * pre_st + i, mask=live, other=0.0)[:, None] * stream.to(tl.float32)
        x = _round(x, dtype)
        tl.store(x_ptr + rows[:, None] * hidden + dd[None, :], x, mask=ok)
        x = x.to(tl.float32)
        x_sq += x * x
    inv_rms = tl.rsqrt(tl.sum(x_sq, axis=1) / hidden + rms_eps)
    tl.debug_barrier()
    for d0 in range(0, hidden, TAIL_D):
        dd = d0 + d
        ok = live[:, None] & (dd < hidden)[None, :]
        x_at = x_ptr + rows[:, None] * hidden + dd[None, :]
        x = tl.load(x_at, mask=ok, other=0.0).to(tl.float32)
        weight = tl.load(norm_w_ptr + dd, mask=dd < hidden, other=0.0)
        tl.store(x_at, _round(weight[None, :] * (x * inv_rms[:, None]), dtype), mask=ok)


@triton.jit
def _tail(acc, sumsq, rows, live, src_ptr, src_st, src_sn, src_sd, base_ptr, scale_ptr, norm_w_ptr, post_ptr,
          comb_ptr, x_ptr, pre_ptr, given_pre_ptr, given_st, hidden, hc_eps, rms_eps, N: tl.constexpr,
          NP: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, TAIL_D: tl.constexpr,
          SINKHORN_ITERS: tl.constexpr, IS_HEAD: tl.constexpr, GIVEN_PRE: tl.constexpr):
    """Phases 2-4. When one tile holds the block's streams, they are loaded before the mixing weights are
    worked out (their latency hides behind the Sinkhorn) and the collapse is normalised in registers.
    `GIVEN_PRE` (V4.1's single pass): the collapse uses `given_pre` `[T, n]` (rows `given_st` apart)
    instead of the `pre` just worked out, which is still stored."""
    if TAIL_D >= hidden:
        j = tl.arange(0, NP)[None, :, None]
        d = tl.arange(0, TAIL_D)[None, None, :]
        ok = live[:, None, None] & (j < N) & (d < hidden)
        streams = tl.load(src_ptr + rows[:, None, None] * src_st + j * src_sn + d * src_sd, mask=ok,
                          other=0.0, cache_modifier=".cg")
        pre = _mixing_weights(acc, sumsq, rows, live, base_ptr, scale_ptr, post_ptr, comb_ptr, pre_ptr,
                              hidden, hc_eps, rms_eps, N, NP, C, BT, SINKHORN_ITERS, IS_HEAD)
        if GIVEN_PRE:
            jp = tl.arange(0, NP)
            pre = tl.load(given_pre_ptr + rows[:, None] * given_st + jp[None, :],
                          mask=live[:, None] & (jp < N)[None, :], other=0.0)
        dtype = x_ptr.dtype.element_ty
        x = _round(tl.sum(pre[:, :, None] * streams.to(tl.float32), axis=1), dtype).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + rms_eps)
        dd = tl.arange(0, TAIL_D)
        weight = tl.load(norm_w_ptr + dd, mask=dd < hidden, other=0.0)
        y = _round(weight[None, :] * (x * inv_rms[:, None]), dtype)
        tl.store(x_ptr + rows[:, None] * hidden + dd[None, :], y, mask=live[:, None] & (dd < hidden)[None, :])
    else:
        _mixing_weights(acc, sumsq, rows, live, base_ptr, scale_ptr, post_ptr, comb_ptr, pre_ptr, hidden,
                        hc_eps, rms_eps, N, NP, C, BT, SINKHORN_ITERS, IS_HEAD)
        tl.debug_barrier()
        if GIVEN_PRE:
            _collapse_norm(rows, live, src_ptr, src_st, src_sn, src_sd, given_pre_ptr, given_st, norm_w_ptr,
                           x_ptr, hidden, rms_eps, N, BT, TAIL_D)
        else:
            _collapse_norm(rows, live, src_ptr, src_st, src_sn, src_sd, pre_ptr, NP, norm_w_ptr, x_ptr, hidden,
                           rms_eps, N, BT, TAIL_D)


@triton.jit(do_not_specialize=["num_rows", "chunks_per_split", "num_splits"])  # one compile for all batch sizes
def hyper_kernel(src_ptr, src_st, src_sn, src_sd, out_ptr, out_st, out_sd, post_in_ptr, comb_in_ptr, rows_ptr,
                 fn_ptr, base_ptr, scale_ptr, norm_w_ptr, new_ptr, post_ptr, comb_ptr, x_ptr, pre_ptr,
                 given_pre_ptr, given_st, part_m_ptr, part_sq_ptr, counter_ptr, num_rows, hidden,
                 chunks_per_split, num_splits, hc_eps, rms_eps,
                 N: tl.constexpr, NP: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                 TAIL_D: tl.constexpr, SG: tl.constexpr, SINKHORN_ITERS: tl.constexpr, HAS_FOLD: tl.constexpr,
                 IS_HEAD: tl.constexpr, IS_SPLIT: tl.constexpr, TAIL: tl.constexpr, SPLIT_DOT: tl.constexpr,
                 EMULATE: tl.constexpr, GIVEN_PRE: tl.constexpr):
    """One program: `BT` output rows x one split of the hidden dim (see the module docstring). Without
    `TAIL` the program only stores its partial sums (`hyper_tail_kernel` goes on from there)."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    rows = block * BT + tl.arange(0, BT)
    live = rows < num_rows
    rows_at = rows.to(tl.int64)
    if IS_HEAD:
        tok = tl.load(rows_ptr + rows, mask=live, other=0).to(tl.int64)
    else:
        tok = rows_at
    dtype = x_ptr.dtype.element_ty
    j = tl.arange(0, NP)
    jj = j[None, :, None]
    d = tl.arange(0, BD)[None, None, :]
    stream_mask = live[:, None, None] & (jj < N)
    # the fn row of accumulator column c: `pre`, `post`, `comb` rows in a [C // NP, NP] grid
    c = tl.arange(0, C)
    cq, cj = c // NP, c % NP
    if IS_HEAD:
        fn_row = cj
        col_ok = (cq == 0) & (cj < N)
    else:
        fn_row = tl.where(cq == 0, cj, tl.where(cq == 1, N + cj, 2 * N + (cq - 2) * N + cj))
        col_ok = (cq < 2 + N) & (cj < N)
    k = tl.arange(0, NP * BD)
    if HAS_FOLD:
        # the mixing weights in the stream dtype first, as the reference's residual has them
        post_in = tl.load(post_in_ptr + tok[:, None] * N + j[None, :], mask=live[:, None] & (j < N)[None, :],
                          other=0.0)
        post_in = _round(post_in, dtype).to(tl.float32)

    acc = tl.zeros([BT, C], dtype=tl.float32)
    sq = tl.zeros([BT, NP * BD], dtype=tl.float32)
    first = split * chunks_per_split
    for chunk in range(first, tl.minimum(first + chunks_per_split, tl.cdiv(hidden, BD))):
        d0 = chunk * BD
        d_ok = (d0 + d) < hidden
        if HAS_FOLD:
            block_out = tl.load(out_ptr + tok[:, None, None] * out_st + (d0 + d) * out_sd,
                                mask=live[:, None, None] & d_ok, other=0.0).to(tl.float32)
            mixed = tl.zeros([BT, NP, BD], dtype=tl.float32)
            for i in tl.static_range(N):
                old = tl.load(src_ptr + tok[:, None, None] * src_st + i * src_sn + (d0 + d) * src_sd,
                              mask=live[:, None, None] & d_ok, other=0.0).to(tl.float32)
                comb_i = tl.load(comb_in_ptr + tok[:, None] * (N * N) + i * N + j[None, :],
                                 mask=live[:, None] & (j < N)[None, :], other=0.0)
                mixed += _round(comb_i, dtype).to(tl.float32)[:, :, None] * old
            # the reference's three roundings: the product, the matmul and their sum
            scaled = _round(post_in[:, :, None] * block_out, dtype).to(tl.float32)
            new = _round(scaled + _round(mixed, dtype).to(tl.float32), dtype)
            tl.store(new_ptr + (rows_at[:, None, None] * N + jj) * hidden + d0 + d, new,
                     mask=stream_mask & d_ok)
            new = new.to(tl.float32)
        else:
            new = tl.load(src_ptr + tok[:, None, None] * src_st + jj * src_sn + (d0 + d) * src_sd,
                          mask=stream_mask & d_ok, other=0.0).to(tl.float32)
        flat = tl.reshape(new, [BT, NP * BD])
        sq += flat * flat
        # dot row k = stream * BD + channel (as `flat` is laid out), loaded straight into the 2-D tile: at
        # 8K tokens this form ran faster on the H200 than a 3-D [stream, channel, column] tile reshaped to
        # 2-D (bench/RESULTS.md, 2026-11-29, commit bd73305)
        k_ok = ((k // BD) < N) & (d0 + k % BD < hidden)
        w = tl.load(fn_ptr + fn_row[None, :] * (N * hidden) + ((k // BD) * hidden + d0 + k % BD)[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SPLIT_DOT:
            acc = _dot_bf16x3(flat, w, acc, EMULATE)
        elif BT >= 16:
            acc = tl.dot(flat, w, acc, input_precision="ieee")
        else:
            acc += tl.sum(flat[:, :, None] * w[None, :, :], axis=1)
    sumsq = tl.sum(sq, axis=1)

    if HAS_FOLD:  # the collapse reads the new streams
        src_ptr, src_st, src_sn, src_sd = new_ptr, N * hidden, hidden, 1
    if IS_SPLIT:
        padded = tl.num_programs(0) * BT
        tl.store(part_m_ptr + (split * padded + rows[:, None]) * C + c[None, :], acc)
        tl.store(part_sq_ptr + split * padded + rows, sumsq)
        if TAIL:
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + block, 1, sem="acq_rel")
            tl.debug_barrier()
            if arrived == num_splits - 1:
                tl.atomic_xchg(counter_ptr + block, 0)
                acc, sumsq = _combine_partials(part_m_ptr, part_sq_ptr, rows, num_splits, padded, BT, C, SG)
                _tail(acc, sumsq, rows_at, live, src_ptr, src_st, src_sn, src_sd, base_ptr, scale_ptr,
                      norm_w_ptr, post_ptr, comb_ptr, x_ptr, pre_ptr, given_pre_ptr, given_st, hidden, hc_eps,
                      rms_eps, N, NP, C, BT, TAIL_D, SINKHORN_ITERS, IS_HEAD, GIVEN_PRE)
    else:
        tl.debug_barrier()
        _tail(acc, sumsq, rows_at, live, src_ptr, src_st, src_sn, src_sd, base_ptr, scale_ptr, norm_w_ptr,
              post_ptr, comb_ptr, x_ptr, pre_ptr, given_pre_ptr, given_st, hidden, hc_eps, rms_eps, N, NP, C,
              BT, TAIL_D, SINKHORN_ITERS, IS_HEAD, GIVEN_PRE)


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def hyper_tail_kernel(src_ptr, src_st, src_sn, src_sd, base_ptr, scale_ptr, norm_w_ptr, post_ptr, comb_ptr,
                      x_ptr, pre_ptr, given_pre_ptr, given_st, part_m_ptr, part_sq_ptr, num_rows, padded,
                      hidden, num_splits, hc_eps, rms_eps, N: tl.constexpr, NP: tl.constexpr, C: tl.constexpr,
                      BT: tl.constexpr, TAIL_D: tl.constexpr, SG: tl.constexpr, SINKHORN_ITERS: tl.constexpr,
                      IS_HEAD: tl.constexpr, GIVEN_PRE: tl.constexpr):
    """The two-pass path's second launch: `BT` rows a program add up the partial sums `hyper_kernel`
    stored and go on with phases 2-4, so the collapse of many tokens is spread over the whole GPU."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    live = rows < num_rows
    acc, sumsq = _combine_partials(part_m_ptr, part_sq_ptr, rows, num_splits, padded, BT, C, SG)
    _tail(acc, sumsq, rows.to(tl.int64), live, src_ptr, src_st, src_sn, src_sd, base_ptr, scale_ptr,
          norm_w_ptr, post_ptr, comb_ptr, x_ptr, pre_ptr, given_pre_ptr, given_st, hidden, hc_eps, rms_eps, N,
          NP, C, BT, TAIL_D, SINKHORN_ITERS, IS_HEAD, GIVEN_PRE)


def hc_pre(streams: torch.Tensor, hc: HyperWeights, norm_weight: torch.Tensor, spec: LayerOpsSpec, *,
           counters: torch.Tensor | None = None, plan: LaunchPlan | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`LayerOps.hc_pre`: `post` fp32 `[T, n]`, `comb` fp32 `[T, n, n]`, `x` `[T, D]` in the stream dtype.

    `streams` `[T, n, D]` is read through its strides (a stride-0 expand of the embedding is fine). The
    three launchers take `plan` when given (deterministic mode: one plan for any row count), else
    `launch_plan`'s."""
    _check_streams(streams, spec)
    _check_weights(hc, spec, is_head=False)
    num_tokens, n, hidden = streams.shape
    post = streams.new_empty((num_tokens, n), dtype=torch.float32)
    comb = streams.new_empty((num_tokens, n, n), dtype=torch.float32)
    x = streams.new_empty((num_tokens, hidden))
    _launch(streams, None, None, None, None, hc, norm_weight, spec, None, post, comb, x, counters, plan)
    return post, comb, x


def hc_post_pre(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                hc: HyperWeights, norm_weight: torch.Tensor, spec: LayerOpsSpec, *,
                counters: torch.Tensor | None = None, plan: LaunchPlan | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`LayerOps.hc_post_pre`: the new streams `[T, n, D]` (contiguous), then `hc_pre`'s three outputs."""
    _check_streams(streams, spec)
    _check_weights(hc, spec, is_head=False)
    num_tokens, n, hidden = streams.shape
    new = streams.new_empty((num_tokens, n, hidden))
    new_post = streams.new_empty((num_tokens, n), dtype=torch.float32)
    new_comb = streams.new_empty((num_tokens, n, n), dtype=torch.float32)
    x = streams.new_empty((num_tokens, hidden))
    _launch(streams, block_out, post, comb, None, hc, norm_weight, spec, new, new_post, new_comb, x, counters,
            plan)
    return new, new_post, new_comb, x


def hc_post_head(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 rows: torch.Tensor, head: HyperWeights, norm_weight: torch.Tensor, spec: LayerOpsSpec, *,
                 counters: torch.Tensor | None = None, plan: LaunchPlan | None = None) -> torch.Tensor:
    """`LayerOps.hc_post_head`: `[R, D]` in the stream dtype for the `R` token indices `rows`."""
    _check_streams(streams, spec)
    _check_weights(head, spec, is_head=True)
    n, hidden = spec.hc_mult, spec.hidden_size
    num_rows = rows.shape[0]
    new = streams.new_empty((num_rows, n, hidden))  # the folded rows, read back by the collapse
    hidden_out = streams.new_empty((num_rows, hidden))
    _launch(streams, block_out, post, comb, rows, head, norm_weight, spec, new, None, None, hidden_out,
            counters, plan)
    return hidden_out


def _launch(streams, block_out, post, comb, rows, hc: HyperWeights, norm_weight, spec: LayerOpsSpec, new,
            post_out, comb_out, x, counters, plan: LaunchPlan | None = None,
            collapse_pre: torch.Tensor | None = None) -> torch.Tensor:
    """Run the boundary; returns phase 2's `pre` `[T, n]` (a view of the scratch)."""
    n, hidden = spec.hc_mult, spec.hidden_size
    num_rows = x.shape[0]
    if num_rows == 0:
        return x.new_zeros((0, n), dtype=torch.float32)
    is_head, has_fold = rows is not None, block_out is not None
    plan = plan or launch_plan(num_rows, n, hidden, is_head, x.device)
    num_blocks = triton.cdiv(num_rows, plan.block_tokens)
    padded = num_blocks * plan.block_tokens
    pre = x.new_empty((padded, plan.n_pow2), dtype=torch.float32)
    part_m = part_sq = pre  # placeholders where unread
    stores_partials = plan.num_splits > 1 or plan.two_pass
    if stores_partials:
        part_m = x.new_empty((plan.num_splits, padded, plan.num_cols), dtype=torch.float32)
        part_sq = x.new_empty((plan.num_splits, padded), dtype=torch.float32)
        if counters is None and not plan.two_pass:
            counters = torch.zeros(num_blocks, dtype=torch.int32, device=x.device)
    common = {"N": n, "NP": plan.n_pow2, "C": plan.num_cols, "SINKHORN_ITERS": spec.hc_sinkhorn_iters,
              "IS_HEAD": is_head, "GIVEN_PRE": collapse_pre is not None}
    if collapse_pre is not None and collapse_pre.stride(1) != 1:
        collapse_pre = collapse_pre.contiguous()
    given = (pre, 0) if collapse_pre is None else (collapse_pre, collapse_pre.stride(0))
    # the second launch's rows stay within the first's padded rows (both powers of two)
    tail_tokens = min(plan.tail_tokens, plan.block_tokens) if plan.two_pass else plan.block_tokens
    # splits combined a loop step: from the hidden dim's chunk count (the most splits a call can have), not
    # from this call's, so every batch size of a token-block size shares one compile
    most_splits = triton.cdiv(hidden, plan.block_d)
    tail = {"TAIL_D": min(triton.next_power_of_2(hidden), max(32, 4096 // tail_tokens)),
            "SG": max(1, min(triton.next_power_of_2(most_splits), 8192 // (tail_tokens * plan.num_cols)))}
    hyper_kernel[(num_blocks, plan.num_splits)](
        streams, *streams.stride(),
        x if block_out is None else block_out, *((0, 0) if block_out is None else block_out.stride()),
        pre if post is None else post.contiguous(), pre if comb is None else comb.contiguous(),
        pre if rows is None else rows,
        hc.fn.contiguous(), hc.base, hc.scale, norm_weight,
        x if new is None else new, pre if post_out is None else post_out,
        pre if comb_out is None else comb_out, x, pre, *given, part_m, part_sq, pre if counters is None else counters,
        num_rows, hidden, plan.chunks_per_split, plan.num_splits, spec.hc_eps, spec.rms_norm_eps,
        BT=plan.block_tokens, BD=plan.block_d, HAS_FOLD=has_fold, IS_SPLIT=stores_partials,
        TAIL=not plan.two_pass, SPLIT_DOT=plan.split_dot and x.dtype == torch.bfloat16,
        EMULATE=x.device.type != "cuda", num_warps=TWO_PASS_TILE[1] if plan.two_pass else 8, **common, **tail,
    )
    if plan.two_pass:
        if has_fold:  # the collapse reads the new streams
            src, strides = new, (n * hidden, hidden, 1)
        else:
            src, strides = streams, streams.stride()
        hyper_tail_kernel[(triton.cdiv(num_rows, tail_tokens),)](
            src, *strides, hc.base, hc.scale, norm_weight, pre if post_out is None else post_out,
            pre if comb_out is None else comb_out, x, pre, *given, part_m, part_sq, num_rows, padded, hidden,
            plan.num_splits, spec.hc_eps, spec.rms_norm_eps, BT=tail_tokens,
            num_warps=8 if tail["TAIL_D"] >= hidden else 4, **common, **tail,  # a whole row's streams in registers
        )
    return pre[:num_rows, :n]


class LaunchPlan(NamedTuple):
    block_tokens: int
    """Tokens per program (`BT`)."""
    block_d: int
    """Hidden channels of every stream per phase-1 step (`BD`)."""
    num_splits: int
    chunks_per_split: int
    n_pow2: int
    num_cols: int
    """Dot-product columns (`C`): `fn` rows as a `[C // n_pow2, n_pow2]` grid."""
    two_pass: bool = False
    """Phase 1 in one launch, phases 2-4 in a second over `tail_tokens`-row programs."""
    split_dot: bool = False
    """The `fn` dot on tensor cores as three bf16 products (`_dot_bf16x3`) when the streams are bf16
    (two-pass calls of 16+ tokens a program)."""
    tail_tokens: int = TAIL_TOKENS
    """Rows a program of the two-pass path's second launch (at most `block_tokens`). With one, a row's
    streams fit one register tile and the collapse is normalised there; the sum of squares then runs
    over the whole row at once instead of per chunk, so it is not the same rounding as more rows a program."""


def launch_plan(num_rows: int, n: int, hidden: int, is_head: bool, device: torch.device) -> LaunchPlan:
    """How a call is cut up: `block_tokens` per program, the hidden dim in `block_d` chunks over
    `num_splits` programs per token block; more than one split when token blocks alone leave SMs idle.
    From `TWO_PASS_MIN_ROWS` rows on, two launches (see `LaunchPlan.two_pass`)."""
    block_tokens = next((bt for limit, bt in BLOCK_TOKENS if num_rows <= limit), 64)
    n_pow2 = triton.next_power_of_2(n)
    num_cols = triton.next_power_of_2(n_pow2 * (1 if is_head else 2 + n_pow2))
    two_pass = num_rows >= TWO_PASS_MIN_ROWS
    if block_tokens >= 16:
        num_cols = max(num_cols, 16)  # tl.dot needs every dim >= 16
        block_d = TWO_PASS_TILE[0] if two_pass else 64
    else:  # the broadcast product [BT, n_pow2 * BD, C] stays within 8K elements
        block_d = min(64, max(8, 8192 // (block_tokens * n_pow2 * num_cols)))
    num_blocks = triton.cdiv(num_rows, block_tokens)
    num_chunks = triton.cdiv(hidden, block_d)
    num_splits = 1
    if two_pass:
        target = TWO_PASS_TILE[2] * _target_programs(device) // 2
        num_splits = max(1, min(num_chunks, triton.cdiv(target, num_blocks)))
    elif num_blocks <= MAX_SPLIT_BLOCKS:
        num_splits = max(1, min(num_chunks, _target_programs(device) // num_blocks))
    chunks_per_split = triton.cdiv(num_chunks, num_splits)
    num_splits = triton.cdiv(num_chunks, chunks_per_split)
    # one launch keeps the fp32 dot: at 256 tokens the three bf16 products took 0.171 ms a call, fp32 0.142
    return LaunchPlan(block_tokens, block_d, num_splits, chunks_per_split, n_pow2, num_cols, two_pass,
                      two_pass and block_tokens >= 16 and TENSOR_CORE_DOT)


def _target_programs(device: torch.device) -> int:
    """About two programs an SM: enough to spread a small batch's `fn` read over the whole GPU."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton's interpreter runs programs one by one: a few splits exercise the split path


def _check_streams(streams: torch.Tensor, spec: LayerOpsSpec) -> None:
    expected = (spec.hc_mult, spec.hidden_size)
    if streams.dim() != 3 or tuple(streams.shape[1:]) != expected:
        raise ValueError(f"streams must be [num_tokens, hc_mult, hidden_size] = [T, {expected[0]}, "
                         f"{expected[1]}], got {tuple(streams.shape)}")


def _check_weights(hc: HyperWeights, spec: LayerOpsSpec, is_head: bool) -> None:
    n = spec.hc_mult
    num_fn_rows = n if is_head else (2 + n) * n
    expected = (num_fn_rows, n * spec.hidden_size)
    if tuple(hc.fn.shape) != expected or hc.fn.dtype != torch.float32:
        raise ValueError(f"{'head' if is_head else 'block'} mHC fn must be fp32 {list(expected)}, "
                         f"got {hc.fn.dtype} {list(hc.fn.shape)}")
