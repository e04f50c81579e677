"""Small building blocks of the V4 model; parameter names follow transformers' checkpoint names."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_core.backends import quant
from deepinfer_core.backends.layer_ops import HyperWeights
from deepinfer_core.backends.linear import LinearBackend, LinearSpec

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
    the dense parameters' names plus `_scale` (layout: `deepinfer_core.backends.quant`)."""

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


class FP8Linear(nn.Module):
    """A projection kept in the checkpoint's FP8 bytes (`quantized_weights="native"`): `weight`
    float8_e4m3fn `[out, in]` and `weight_scale` float32 block scales (`LinearSpec.scale_shape`), run by
    the `LinearBackend` bound after loading (`weight_formats.bind_linears`). It replaces an `nn.Linear`
    (or a `GroupedLinear`, `spec.groups > 1`) whose checkpoint weight is FP8."""

    def __init__(self, spec: LinearSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.zeros(spec.out_features, spec.in_features, dtype=quant.FP8_DTYPE),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.zeros(spec.scale_shape, dtype=FP32), requires_grad=False)
        self.backend: LinearBackend | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            raise RuntimeError("FP8Linear has no LinearBackend: bind one (weight_formats.bind_linears) after loading")
        return self.backend.forward(x, self.weight, self.weight_scale)


class ConcatenatedLinears:
    """Bias-free projections of one input run as one matmul: each `nn.Linear`'s weight is re-pointed at
    its rows of one concatenated matrix (no second copy stays), and the output is split back.

    `FP8Linear` members run on their own (their block scales need not align where they would join);
    each run of dense neighbours is still one matmul."""

    def __init__(self, linears: list[nn.Module]) -> None:
        self.parts: list[tuple[torch.Tensor | None, list[int], nn.Module | None]] = []
        for is_fp8, run in itertools.groupby(linears, key=lambda linear: isinstance(linear, FP8Linear)):
            run = list(run)
            if is_fp8:
                self.parts += [(None, [linear.spec.out_features], linear) for linear in run]
                continue
            weight = torch.cat([linear.weight.detach() for linear in run])
            sizes = [linear.weight.shape[0] for linear in run]
            for linear, rows in zip(run, weight.split(sizes)):
                linear.weight = nn.Parameter(rows, requires_grad=False)
            self.parts.append((weight, sizes, None))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self.parts) == 1 and self.parts[0][2] is None:
            weight, sizes, _ = self.parts[0]
            return F.linear(x, weight).split(sizes, dim=-1)
        outputs: list[torch.Tensor] = []
        for weight, sizes, module in self.parts:
            outputs += [module(x)] if module is not None else F.linear(x, weight).split(sizes, dim=-1)
        return tuple(outputs)
