"""Linear contract: one projection `y = x @ W.T` whose weight may stay in the checkpoint's FP8 bytes.

Dense projections (weights in the compute dtype) run as `F.linear` in the model, exactly as before; only
projections whose checkpoint weights are block-scaled FP8 (`quantized_weights="native"`) go through a
`LinearBackend`, built once per distinct `LinearSpec` by the `make_linear` hook.

FP8 layout (`deepinfer_core.backends.quant`): `weight[out, in]` float8_e4m3fn and one float32 scale per
`block[0] x block[1]` tile (`scale[ceil(out / block[0]), ceil(in / block[1])]`), `W = weight * scale`.
DeepSeek-V4 ships 128x128 tiles with float32 scales, V4.1 32x32 tiles with power-of-two ("ue8m0")
scales; either way the model holds the scales as float32 (exact for ue8m0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from deepinfer_core.backends.graphs import GraphCapturable

WEIGHT_FORMATS = ("dense", "fp8")
"""Every `LinearSpec.weight_format`."""
SCALE_FORMATS = ("float32", "ue8m0")
"""Every `LinearSpec.scale_format`."""


class LinearSpecError(ValueError):
    """A `LinearSpec` that describes no valid projection (the message names the field)."""


@dataclass(frozen=True)
class LinearSpec:
    """What one projection needs; one backend is built per distinct spec."""

    in_features: int
    """Input width of one group (the whole input when `groups == 1`)."""
    out_features: int
    """Output width over all groups."""
    groups: int = 1
    """Block-diagonal groups (V4's `o_a_proj`): group g maps `x[:, g]` to its own `out_features // groups`
    outputs, rows `g * out_features // groups ...` of the weight; 1 for a plain projection."""
    weight_format: Literal["dense", "fp8"] = "fp8"
    """"dense": the weight is in `dtype`; "fp8": float8_e4m3fn with block scales (see the module doc)."""
    block: tuple[int, int] = (128, 128)
    """FP8 scale tile `(rows, cols)`: (128, 128) for V4, (32, 32) for V4.1."""
    scale_format: Literal["float32", "ue8m0"] = "float32"
    """How the checkpoint stores the scales: any float32, or powers of two ("ue8m0"). A backend that
    quantises activations uses the same kind of scale for them, as DeepSeek's kernels do."""
    dtype: torch.dtype = torch.bfloat16
    """Activation (input and output) dtype."""

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise LinearSpecError(f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if self.scale_format not in SCALE_FORMATS:
            raise LinearSpecError(f"scale_format must be one of {SCALE_FORMATS}, got {self.scale_format!r}")
        if self.groups < 1 or self.out_features % self.groups:
            raise LinearSpecError(f"out_features ({self.out_features}) must split into groups ({self.groups})")
        if min(self.in_features, self.out_features, *self.block) < 1:
            raise LinearSpecError(f"sizes and block must be positive, got {self}")

    @property
    def scale_shape(self) -> tuple[int, int]:
        """Shape of the FP8 block scales of the whole weight `[out_features, in_features]`."""
        return -(-self.out_features // self.block[0]), -(-self.in_features // self.block[1])


@runtime_checkable
class LinearBackend(GraphCapturable, Protocol):
    """Runs one projection of `spec`'s kind (any weights of its shapes and format)."""

    spec: LinearSpec

    def forward(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T` with `W = weight * scale` expanded over its tiles (or `weight` when dense).

        A backend may quantise `x` (DeepSeek's kernels quantise it per token and 128 inputs to FP8 with
        fp32 accumulation); the reference does not, and is the oracle (`testing.conformance.check_linear`
        bounds the difference by the format's rounding).

        :param x: `[num_tokens, in_features]`, or `[num_tokens, groups, in_features]` when `groups > 1`,
            in `spec.dtype`.
        :param weight: `[out_features, in_features]` float8_e4m3fn (fp8) or `spec.dtype` (dense).
        :param scale: `spec.scale_shape` float32 block scales (fp8), None when dense.
        :returns: `[num_tokens, out_features]` in `spec.dtype`.
        """
        ...
