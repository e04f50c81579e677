"""V4's partial, interleaved rotary embedding: `main` (plain) for sliding layers, `compress` (YaRN) else."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(rope: dict, rope_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies `[rope_dim // 2]` (fp32) for one rope-parameter dict."""
    base = float(rope["rope_theta"])
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    inv_freq = 1.0 / (base**exponents)
    if rope.get("rope_type", "default") == "default":
        return inv_freq
    if rope["rope_type"] != "yarn":
        raise NotImplementedError(f"a rope_type other than 'default' or 'yarn': rope_type {rope['rope_type']!r}")
    return _yarn(inv_freq, rope, rope_dim, base)


def _yarn(inv_freq: torch.Tensor, rope: dict, rope_dim: int, base: float) -> torch.Tensor:
    # YaRN blends interpolated (divided by `factor`) and original frequencies with a linear ramp over
    # the dims whose wavelength falls between beta_fast and beta_slow rotations of the original context.
    factor = float(rope["factor"])
    original_len = float(rope["original_max_position_embeddings"])
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return rope_dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    return inv_freq / factor * (1 - keep_original) + inv_freq * keep_original


def rope_scaling(rope: dict) -> float:
    """The multiplier on cos/sin (YaRN's attention factor; V4 checkpoints set 1.0)."""
    if rope.get("rope_type", "default") != "yarn":
        return 1.0
    factor = rope.get("attention_factor")
    if factor is not None:
        return float(factor)
    scale = float(rope["factor"])
    return 1.0 if scale <= 1 else 0.1 * math.log(scale) + 1.0


class Rotary:
    """Cos/sin for positions, and the interleaved rotation of the trailing `rope_dim` channels."""

    def __init__(self, rope: dict, rope_dim: int, device: torch.device) -> None:
        self.rope_dim = rope_dim
        self.inv_freq = inverse_frequencies(rope, rope_dim).to(device)
        self.scaling = rope_scaling(rope)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[N, rope_dim // 2]` fp32 cos and sin for integer positions `[N]`."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling


def rope_tables(rotary: dict[str, Rotary], ops,
                positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`CausalLM.rope_tables` of a model with one `Rotary` per rope kind: cos, sin and -sin of `positions`,
    each computed through `ops.map_rows` (fixed row tiles in deterministic mode)."""
    tables = {}
    for name, table in rotary.items():
        cos, sin = ops.map_rows(table.cos_sin, positions)
        tables[name] = (cos, sin, -sin)
    return tables
