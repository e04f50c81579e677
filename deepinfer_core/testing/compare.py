"""Tolerances and the tensor comparison every conformance check uses."""

from __future__ import annotations

import torch

TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
"""Default `(atol, rtol)` per candidate dtype, for outputs of order 1."""


def tolerances(dtype: torch.dtype, atol: float | None = None, rtol: float | None = None) -> tuple[float, float]:
    """`(atol, rtol)` for `dtype`, each overridden when given."""
    default_atol, default_rtol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    return (default_atol if atol is None else atol, default_rtol if rtol is None else rtol)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str,
                 equal_nan: bool = False) -> None:
    """`AssertionError` naming `what` unless `actual` (any device and dtype) matches the fp32 `expected`.

    Without `equal_nan` any NaN in `actual` fails (a backend read a row it must not); with it, NaN must
    stand exactly where `expected` has NaN (rows that must stay unwritten)."""
    actual = actual.detach().float().cpu()
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {list(actual.shape)}, expected {list(expected.shape)}")
    if not equal_nan and torch.isnan(actual).any():
        raise AssertionError(f"{what}: NaN in the output (did the backend read a cache row it must not?)")
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=equal_nan,
                               msg=lambda m: f"{what}: {m}")
