"""Reference `LinearBackend`: dequantises the FP8 weight per call and runs the GEMM in the activation dtype.

The values are those the dequantise-at-load path holds (`quant.dequantize_fp8(...)` cast to the
compute dtype), so a model on this backend computes what `quantized_weights="dequantize"` computes,
while keeping the FP8 bytes in memory. Activations are never quantised: this is the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backends import quant
from deepinfer_core.backends.linear import LinearSpec


class ReferenceLinear:
    """Pure-PyTorch `LinearBackend`, any device."""

    supports_cuda_graphs = True
    """Only tensor ops sized by shapes; no host reads."""

    def __init__(self, spec: LinearSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device

    def dense_weight(self, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """The weight in the activation dtype, `[out_features, in_features]`."""
        if self.spec.weight_format == "dense":
            return weight
        if scale is None:
            raise ValueError("an FP8 linear needs its block scales")
        return quant.dequantize_fp8(weight, scale, self.spec.block).to(self.spec.dtype)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        w = self.dense_weight(weight, scale)
        groups = self.spec.groups
        if groups == 1:
            return F.linear(x, w)
        w = w.view(groups, -1, x.shape[-1]).transpose(1, 2)  # [groups, in, out / groups]
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)
