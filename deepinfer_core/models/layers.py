"""Small building blocks of the V4 model; parameter names follow transformers' checkpoint names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_core.backends.layer_ops import HyperWeights
from deepinfer_core.models import quant

FP32 = torch.float32
"""The dtype of the parameters V4 keeps in float32 whatever the compute dtype, as transformers'
`_keep_in_fp32_modules_strict` does: norm weights, mHC parameters, attention sinks, compressor position
biases and the router's score-correction bias. Each module declares those with `dtype=FP32` (and the rest
in the compute dtype); the loader and the runner read every tensor's dtype from the modules
(`checkpoint_layout.tensor_schema`), never from a list of their own."""


class RMSNorm(nn.Module):
    """An RMSNorm's fp32 weight; the norm itself runs in the `LayerOps` backend."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=FP32))


class HyperConnection(nn.Module):
    """mHC parameters of one block site (`hc_mult` streams collapsed into the block input and the block
    output folded back in); the mixing itself runs in the `LayerOps` backend."""

    def __init__(self, hc_mult: int, hidden_size: int) -> None:
        super().__init__()
        n = hc_mult
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size, dtype=FP32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=FP32))
        self.scale = nn.Parameter(torch.ones(3, dtype=FP32))

    def weights(self) -> HyperWeights:
        return HyperWeights(self.fn, self.base, self.scale)


class HyperHead(nn.Module):
    """Final collapse of the `hc_mult` streams before the output norm."""

    def __init__(self, hc_mult: int, hidden_size: int) -> None:
        super().__init__()
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size, dtype=FP32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=FP32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=FP32))

    def weights(self) -> HyperWeights:
        return HyperWeights(self.hc_fn, self.hc_base, self.hc_scale)


class SharedExpert(nn.Module):
    """The always-on SwiGLU expert, with V4's clamp on the gate (max) and up (both sides)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.limit = limit
        self.gate_up: ConcatenatedLinears | None = None

    def bind(self) -> None:
        """Once the weights are loaded: gate and up as one matmul."""
        self.gate_up = ConcatenatedLinears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj(F.silu(gate) * up)


class FP4Experts(nn.Module):
    """Routed experts kept in the checkpoint's FP4 bytes (`MoESpec.expert_format == "fp4"`): packed e2m1
    codes (int8, two a byte, the input dim halved) and one float8_e8m0fnu scale per 32 inputs, under
    the dense parameters' names plus `_scale` (layout: `deepinfer_core.models.quant`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        if h % quant.FP4_GROUP_SIZE or i % quant.FP4_GROUP_SIZE:
            raise ValueError(f"FP4 experts need hidden ({h}) and moe_intermediate ({i}) sizes divisible by "
                             f"{quant.FP4_GROUP_SIZE}; load with quantized_weights='dequantize'")

        def frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)

        self.gate_up_proj = frozen(*quant.fp4_packed_shape((e, 2 * i, h)), dtype=torch.int8)
        self.gate_up_proj_scale = frozen(*quant.fp4_scale_shape((e, 2 * i, h)), dtype=quant.FP4_SCALE_DTYPE)
        self.down_proj = frozen(*quant.fp4_packed_shape((e, h, i)), dtype=torch.int8)
        self.down_proj_scale = frozen(*quant.fp4_scale_shape((e, h, i)), dtype=quant.FP4_SCALE_DTYPE)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: group g of the input maps to its own `out // groups` outputs."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.zeros(out_features, in_per_group, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[T, groups, in_per_group]` -> `[T, out_features]`."""
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)  # [g, in, out]
        # a plain batched GEMM over groups (an einsum here picked slow fallback kernels on Hopper)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)


class ConcatenatedLinears:
    """Bias-free projections of one input run as one matmul: each `nn.Linear`'s weight is re-pointed at
    its rows of one concatenated matrix (no second copy stays), and the output is split back."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.weight = torch.cat([linear.weight.detach() for linear in linears])
        self.sizes = [linear.weight.shape[0] for linear in linears]
        for linear, rows in zip(linears, self.weight.split(self.sizes)):
            linear.weight = nn.Parameter(rows, requires_grad=False)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight).split(self.sizes, dim=-1)
