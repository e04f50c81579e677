"""Routed MoE on NVIDIA GPUs: Triton routing, expert-sorted rows, two fused grouped GEMMs.

One step does, with no host synchronisation (so the whole forward can be captured in a CUDA graph):

1. router logits `x @ router.T` in fp32 (cuBLAS; bf16 inputs multiplied as they are, into fp32), then
   one Triton program per token scores the experts,
   picks the top k (or reads `tid2eid`), normalises and scales the weights;
2. `sort_rows_by_expert`: the flat `(token, k)` rows are sorted by expert and each expert's run is padded
   to a multiple of `BLOCK_M` (torch ops on the device);
3. `gate_up_kernel`: one program per (row block, output tile) reads the block's expert tile once and
   writes the clamped SwiGLU activation;
4. `down_kernel`: the same for the down projection, multiplied by the routing weight, written back at
   each row's original place; the `top_k` rows of a token are then summed in fp32.

FP4 experts (`MoESpec.expert_format == "fp4"`) read a quarter of bf16's bytes: at decode sizes
`fp4_gemv_kernels` multiply the decoded tiles with each real row on CUDA cores (`FP4_GEMV`); beyond 16
rows an expert the experts are dequantised for the call and the dense tiles run (`kernel="dequant"`).
The same kernels can also decode each weight tile in registers (`kernel="tile"`, the fp32 oracle of the
other two in the tests).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from deepinfer_core.backends.moe import MoESpec, MoEWeights
from deepinfer_nvidia_sm100.fp4_gemv_kernels import (
    dequantize_experts,
    fp4_down_gemv_kernel,
    fp4_gate_up_gemv_kernel,
    gemv_grid,
)
from deepinfer_nvidia_sm100.fp4_mma_kernels import (
    CODES_PER_ELEMENT,
    DECODES,
    fp4_mma_down_kernel,
    fp4_mma_gate_up_kernel,
)
from deepinfer_nvidia_sm100.moe_kernels import SCORING_CODES, down_kernel, gate_up_kernel, route_kernel

KERNELS = ("tile", "gemv", "dequant", *DECODES)
"""The grouped GEMMs' kernels (`GemmConfig.kernel`)."""

MAX_GRID_Y = 65535
"""CUDA's limit on a launch grid's second dimension."""


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of the two grouped GEMMs."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    n_fastest: bool = False
    """Launch every output tile of a row block before the next row block (see `moe_kernels._tile`)."""
    kernel: str = "tile"
    """FP4 experts: "mma" (bf16 activations: the weights as the tensor-core MMA's first operand, decoded
    by `tl.dot_scaled`, `fp4_mma_kernels`; `block_m` is then the token rows a tile, `block_n` the weight
    rows), "mma_halves", "mma_words" and "mma_pairs" (the same, decoded by hand: `fp4_mma_kernels.DECODES`), "tile" (tensor-core tiles decoded in registers as
    the second operand), "gemv" (CUDA-core products with each real row, `fp4_gemv_kernels`) or "dequant"
    (the experts dequantised to the activations' dtype, then the dense tiles); dense experts always take
    "tile"."""

    def grid(self, num_blocks: int, num_cols: int) -> tuple[tuple[int, int], bool]:
        """The launch grid over `num_blocks` row blocks and `num_cols` output columns, and whether it puts
        the output tiles first (the kernels' `N_FASTEST`): not when the row blocks would exceed CUDA's
        limit on a grid's second dimension."""
        n_tiles = triton.cdiv(num_cols, self.block_n)
        if self.n_fastest and num_blocks <= MAX_GRID_Y:
            return (n_tiles, num_blocks), True
        return (num_blocks, n_tiles), False


FP4_GEMV = GemmConfig(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=2, kernel="gemv")
"""FP4 experts at decode sizes (at most 16 rows an expert). H200, V4-Flash sizes, both GEMMs
(`bench/prefill_tiles.py --only fp4`, bench/RESULTS.md): 16 tokens 1.22 ms, 64 tokens 3.65 ms (1.99 /
5.55 when it decoded a byte at a time), against 3.47 / 7.75 ms for the register-decoded tensor-core tiles
and 1.04 / 2.33 ms for bf16 experts; wider output tiles (64 or 128 columns) at 4 warps run 6-8x slower."""


FP4_MMA_DECODE = GemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3, kernel="mma_words")
"""FP4 experts with bf16 activations at decode sizes (at most 16 rows an expert): 16 token rows by 64
weight rows a tile, the weights the MMA's first operand, decoded from 32-bit words (`fp4_mma_kernels`).
H100, V4-Flash sizes, both GEMMs with the routing sort (bench/RESULTS.md, 2026-12-08): 16 tokens 0.96 ms,
64 tokens 2.19 ms, 256 tokens 2.84 ms, against 1.41 / 3.42 / 4.40 ms for bf16 experts, 1.22 / 3.58 / 10.4
for the CUDA-core products (`FP4_GEMV`) and 2.75 / 6.56 / 8.16 for `tl.dot_scaled`'s decode ("mma")."""

FP4_MMA_PREFILL = (GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3, n_fastest=True,
                              kernel="mma_words"),
                   GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, n_fastest=True,
                              kernel="mma_words"))
"""The same beyond 16 rows an expert: 64 token rows a tile up to 96 rows an expert, 128 beyond. H100: 2,048
tokens 5.95 ms (bf16 experts 4.70, dequantised for the call 12.1), 8,192 tokens 15.8 ms (bf16 7.34,
dequantised 16.5)."""


def pick_config(num_rows: int, num_experts: int, element_size: int = 2, fp4: bool = False) -> GemmConfig:
    """Small row blocks when experts see few rows (decode: memory-bound), large ones for prefill. FP4
    experts with bf16 activations (`element_size` 2) take the tensor-core kernels with the weights as the
    MMA's first operand (`FP4_MMA_DECODE`, `FP4_MMA_PREFILL`); with fp32 activations (the CPU tests'
    oracle runs) the CUDA-core products at decode sizes (`FP4_GEMV`) and beyond, the dense tiles on the
    experts dequantised for the call (`kernel="dequant"`).

    `element_size` is the activation/weight dtype's: fp32 tiles take twice the shared memory, so fp32
    keeps tiles whose pipelined stages fit a Hopper SM (227 KiB)."""
    rows_per_expert = num_rows / num_experts
    if fp4 and element_size == 2:
        if rows_per_expert <= 16:
            return FP4_MMA_DECODE
        return FP4_MMA_PREFILL[rows_per_expert > 96]
    if rows_per_expert <= 16:
        if fp4:
            return FP4_GEMV
        return GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    kernel = "dequant" if fp4 else "tile"
    # H200, V4-Flash sizes, 256 experts, both GEMMs (bench/RESULTS.md): 2,048 tokens (48 rows an
    # expert) 3.44 ms with 64x64 tiles (64x256: 3.57); 8,192 tokens (192 rows) 7.23 ms with 128x128
    # (64x256: 7.68), the larger tiles paying for padding each expert's rows to 128
    if element_size > 2 or rows_per_expert <= 96:
        return GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4, n_fastest=True,
                          kernel=kernel)
    return GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, n_fastest=True,
                      kernel=kernel)


DOWN_WIDE = GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, n_fastest=True)
"""The down projection's tiles beside 128-row gate_up tiles (8,192 tokens: 7.23 ms for both GEMMs, 7.36
with 128x128 down tiles)."""


def pick_down_config(gate_up: GemmConfig, element_size: int = 2) -> GemmConfig:
    """The down projection's tiles: the same rows a block as `gate_up` (they share the sorted rows); the
    down kernel holds one accumulator where gate_up holds two, so it can afford wider tiles."""
    if gate_up.block_m == DOWN_WIDE.block_m and element_size == 2 and gate_up.kernel in ("tile", "dequant"):
        return dataclasses.replace(DOWN_WIDE, kernel=gate_up.kernel)
    return gate_up


@dataclass
class SortedRows:
    """Rows laid out expert by expert; `block_expert[b]` is -1 for unused trailing blocks."""

    sorted_rows: torch.Tensor
    """`[num_blocks * block_m]` int32 original row per slot; `num_rows` marks padding."""
    block_expert: torch.Tensor
    """`[num_blocks]` int32 expert of each block of `block_m` slots, -1 when unused."""


def sort_rows_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedRows:
    """Sort the flat rows by expert, padding each expert's run to a multiple of `block_m`.

    Sizes depend only on the row count, never on the routing, so no value is read back to the host.
    """
    flat = expert_ids.reshape(-1).to(torch.int64)
    num_rows = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    count_starts = torch.cumsum(counts, 0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_rows, device=device) - count_starts[sorted_experts]
    destination = padded_starts[sorted_experts] + rank
    max_slots = num_rows + min(num_rows, num_experts) * (block_m - 1)
    num_blocks = triton.cdiv(max_slots, block_m)
    sorted_rows = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[destination] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return SortedRows(sorted_rows=sorted_rows, block_expert=block_expert)


class TritonMoE:
    """`MoEBackend` for CUDA devices of compute capability >= 9.0."""

    supports_cuda_graphs = True
    """Every launch and buffer is sized from the token count alone; no value is read back."""
    expert_formats = ("dense", "fp4")

    def __init__(self, spec: MoESpec) -> None:
        self.spec = spec
        self._scoring = SCORING_CODES[spec.scoring_func]
        self._ieee = spec.dtype == torch.float32
        self._fp4 = spec.expert_format == "fp4"
        if self._fp4 and (spec.hidden_size % 32 or spec.intermediate_size % 32):
            raise ValueError(f"FP4 experts need hidden and intermediate sizes divisible by 32, got {spec}")

    def _scales(self, weights: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP4 scales as uint8 exponents; for dense experts the weights themselves stand in (unread)."""
        if not self._fp4:
            return weights.gate_up, weights.down
        scales = (weights.gate_up_scale, weights.down_scale)
        if any(s is None or s.dtype != torch.float8_e8m0fnu for s in scales):
            raise ValueError("FP4 experts need float8_e8m0fnu MoEWeights.gate_up_scale and down_scale")
        return tuple(s.view(torch.uint8) for s in scales)

    def route(
        self, x: torch.Tensor, input_ids: torch.Tensor, weights: MoEWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `[T, top_k]` int32 expert ids and fp32 weights (normalised, scaled)."""
        spec = self.spec
        num_tokens = x.shape[0]
        logits = self.router_logits(x, weights)
        ids = torch.empty(num_tokens, spec.top_k, dtype=torch.int32, device=x.device)
        topk_weights = torch.empty(num_tokens, spec.top_k, dtype=torch.float32, device=x.device)
        if num_tokens == 0:
            return ids, topk_weights
        if spec.is_hash and weights.tid2eid is None:
            raise ValueError("hash MoE layer needs MoEWeights.tid2eid")
        bias = weights.score_bias if weights.score_bias is not None and not spec.is_hash else None
        tid2eid = weights.tid2eid.contiguous() if spec.is_hash else logits
        route_kernel[(num_tokens,)](
            logits,
            bias if bias is not None else logits,
            tid2eid,
            input_ids.contiguous(),
            ids,
            topk_weights,
            spec.num_experts,
            float(spec.routed_scaling_factor),
            TOP_K=spec.top_k,
            TOP_K_POW2=triton.next_power_of_2(spec.top_k),
            BLOCK_E=triton.next_power_of_2(spec.num_experts),
            SCORING=self._scoring,
            HAS_BIAS=bias is not None,
            IS_HASH=spec.is_hash,
        )
        return ids, topk_weights

    def router_logits(self, x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
        """`[T, num_experts]` fp32 router logits, contiguous."""
        if x.is_cuda and x.dtype == weights.router.dtype == torch.bfloat16:
            # bf16 products are exact in fp32 and cuBLAS adds them in fp32: fp32 logits at bf16 speed
            return torch.mm(x, weights.router.t(), out_dtype=torch.float32)
        return torch.matmul(x.float(), weights.router.float().t()).contiguous()

    @staticmethod
    def sum_slots(rows: torch.Tensor) -> torch.Tensor:
        """`[T, hidden]` sum over the `[T, top_k, hidden]` fp32 rows of each token's picked experts."""
        return rows.sum(dim=1)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
        """Route and run the routed experts (see `MoEBackend.forward`)."""
        ids, topk_weights = self.route(x, input_ids, weights)
        return self.experts(x, ids, topk_weights, weights)

    def experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: MoEWeights,
        config: GemmConfig | None = None,
        down_config: GemmConfig | None = None,
    ) -> torch.Tensor:
        """Weighted sum over each token's picked experts of `down(swiglu(gate_up @ x))`; `config` and
        `down_config` (default: `config`, or both picked from the row count) are the two GEMMs' tiles."""
        spec = self.spec
        num_tokens, hidden = x.shape
        num_rows = num_tokens * spec.top_k
        if num_tokens == 0:
            return torch.zeros_like(x)
        if config is None:
            config = pick_config(num_rows, spec.num_experts, x.element_size(), self._fp4)
            down_config = down_config or pick_down_config(config, x.element_size())
        down_config = down_config or config
        if down_config.block_m != config.block_m:
            raise ValueError(f"the two GEMMs share their sorted rows: block_m {config.block_m} and "
                             f"{down_config.block_m} differ")
        if {config.kernel, down_config.kernel} - set(KERNELS):
            raise ValueError(f"unknown GemmConfig.kernel in {config} / {down_config}: one of {', '.join(KERNELS)}")
        if config.kernel != down_config.kernel or (config.kernel != "tile" and not self._fp4):
            raise ValueError(f"both GEMMs take one kernel, and only FP4 experts another than 'tile': {config} / "
                             f"{down_config}")
        x = x.contiguous()
        gate_up, down = weights.gate_up, weights.down
        gate_up_scale, down_scale = self._scales(weights)
        if any(t.stride(-1) != 1 for t in (gate_up, down, gate_up_scale, down_scale)):
            raise ValueError("expert weights and scales must be contiguous in their last dimension")
        inter = spec.intermediate_size
        rows = sort_rows_by_expert(ids, spec.num_experts, config.block_m)
        num_blocks = rows.block_expert.numel()
        act = torch.empty(num_blocks * config.block_m, inter, dtype=x.dtype, device=x.device)
        if config.kernel in DECODES:
            return self._mma(x, gate_up, gate_up_scale, down, down_scale, act, rows, topk_weights, config,
                             down_config)
        if config.kernel == "gemv":
            return self._gemv(x, gate_up, gate_up_scale, down, down_scale, act, rows, topk_weights, config,
                              down_config)
        fp4 = self._fp4
        if config.kernel == "dequant":  # the scales stay as unread stand-ins
            gate_up, down = dequantize_experts(gate_up, gate_up_scale, x.dtype), dequantize_experts(down, down_scale, x.dtype)
            fp4 = False
        grid, n_fastest = config.grid(num_blocks, inter)
        gate_up_kernel[grid](
            x,
            gate_up,
            gate_up_scale,
            act,
            rows.sorted_rows,
            rows.block_expert,
            num_rows,
            hidden,
            inter,
            float(spec.swiglu_limit),
            x.stride(0),
            gate_up.stride(0),
            gate_up.stride(1),
            gate_up_scale.stride(0),
            gate_up_scale.stride(1),
            act.stride(0),
            TOP_K=spec.top_k,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            HAS_LIMIT=spec.swiglu_limit > 0,
            IEEE=self._ieee,
            N_FASTEST=n_fastest,
            FP4=fp4,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
        grid, n_fastest = down_config.grid(num_blocks, hidden)
        down_kernel[grid](
            act,
            down,
            down_scale,
            out,
            rows.sorted_rows,
            rows.block_expert,
            topk_weights.reshape(-1),
            num_rows,
            hidden,
            inter,
            act.stride(0),
            down.stride(0),
            down.stride(1),
            down_scale.stride(0),
            down_scale.stride(1),
            out.stride(0),
            BLOCK_M=down_config.block_m,
            BLOCK_N=down_config.block_n,
            BLOCK_K=down_config.block_k,
            IEEE=self._ieee,
            N_FASTEST=n_fastest,
            FP4=fp4,
            num_warps=down_config.num_warps,
            num_stages=down_config.num_stages,
        )
        return self.sum_slots(out.view(num_tokens, spec.top_k, hidden)).to(x.dtype)

    def _gemv(self, x, gate_up, gate_up_scale, down, down_scale, act, rows: SortedRows, topk_weights,
              config: GemmConfig, down_config: GemmConfig) -> torch.Tensor:
        """The two FP4 GEMMs as CUDA-core products with each block's real rows (`fp4_gemv_kernels`)."""
        spec = self.spec
        num_tokens, hidden = x.shape
        num_rows, inter = num_tokens * spec.top_k, spec.intermediate_size
        num_blocks = rows.block_expert.numel()
        gate_up, down = gate_up.view(torch.int32), down.view(torch.int32)  # words of eight codes
        fp4_gate_up_gemv_kernel[gemv_grid(num_blocks, inter, config.block_n)](
            x, gate_up, gate_up_scale, act, rows.sorted_rows, rows.block_expert, num_rows, hidden, inter,
            float(spec.swiglu_limit), x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0),
            gate_up_scale.stride(1), act.stride(0), TOP_K=spec.top_k, BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, HAS_LIMIT=spec.swiglu_limit > 0,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
        fp4_down_gemv_kernel[gemv_grid(num_blocks, hidden, down_config.block_n)](
            act, down, down_scale, out, rows.sorted_rows, rows.block_expert, topk_weights.reshape(-1), num_rows,
            hidden, inter, act.stride(0), down.stride(0), down.stride(1), down_scale.stride(0),
            down_scale.stride(1), out.stride(0), BLOCK_M=down_config.block_m, BLOCK_N=down_config.block_n,
            BLOCK_K=down_config.block_k, num_warps=down_config.num_warps, num_stages=down_config.num_stages,
        )
        return self.sum_slots(out.view(num_tokens, spec.top_k, hidden)).to(x.dtype)

    def _mma(self, x, gate_up, gate_up_scale, down, down_scale, act, rows: SortedRows, topk_weights,
             config: GemmConfig, down_config: GemmConfig) -> torch.Tensor:
        """The two FP4 GEMMs with the weights as the tensor-core MMA's first operand (`fp4_mma_kernels`)."""
        spec = self.spec
        if x.dtype != torch.bfloat16:
            raise ValueError(f"the FP4 '{config.kernel}' kernels take bf16 activations, got {x.dtype}")
        num_tokens, hidden = x.shape
        num_rows, inter = num_tokens * spec.top_k, spec.intermediate_size
        num_blocks = rows.block_expert.numel()
        decode = DECODES[config.kernel]
        if CODES_PER_ELEMENT[decode] == 8 and min(config.block_k, down_config.block_k) < 128:
            raise ValueError(f"'{config.kernel}' multiplies column sets of block_k / 8 inputs: block_k must be >= 128, "
                             f"got {config} / {down_config}")
        element = torch.int32 if CODES_PER_ELEMENT[decode] == 8 else torch.uint8  # `tl.dot_scaled` takes uint8
        gate_up, down = gate_up.view(element), down.view(element)
        grid, n_fastest = config.grid(num_blocks, inter)
        fp4_mma_gate_up_kernel[grid](
            x, gate_up, gate_up_scale, act, rows.sorted_rows, rows.block_expert, num_rows, hidden, inter,
            float(spec.swiglu_limit), x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0),
            gate_up_scale.stride(1), act.stride(0), TOP_K=spec.top_k, BLOCK_T=config.block_m,
            BLOCK_W=config.block_n, BLOCK_K=config.block_k, HAS_LIMIT=spec.swiglu_limit > 0, N_FASTEST=n_fastest,
            DECODE=decode, CODES=CODES_PER_ELEMENT[decode], num_warps=config.num_warps, num_stages=config.num_stages,
        )
        out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
        grid, n_fastest = down_config.grid(num_blocks, hidden)
        fp4_mma_down_kernel[grid](
            act, down, down_scale, out, rows.sorted_rows, rows.block_expert, topk_weights.reshape(-1), num_rows,
            hidden, inter, act.stride(0), down.stride(0), down.stride(1), down_scale.stride(0),
            down_scale.stride(1), out.stride(0), BLOCK_T=down_config.block_m, BLOCK_W=down_config.block_n,
            BLOCK_K=down_config.block_k, N_FASTEST=n_fastest, DECODE=decode, CODES=CODES_PER_ELEMENT[decode],
            num_warps=down_config.num_warps, num_stages=down_config.num_stages,
        )
        return self.sum_slots(out.view(num_tokens, spec.top_k, hidden)).to(x.dtype)
