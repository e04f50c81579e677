"""Deterministic (batch-invariant) mode in the backend contracts: what a spec asking for it means.

`EngineConfig.deterministic` sets `deterministic=True` on every `AttentionSpec`, `MoESpec`,
`LayerOpsSpec` and `SamplingSpec` the engine builds. A backend built for such a spec must give each token
(each query, each row) bit-identical results whatever else shares its call and however its request is
split into steps; the reference's variants are in `deepinfer_core.reference.invariant`. A plugin whose
kernels do not guarantee that declines those specs (`deterministic_problem`), and the reference serves them.
"""

from __future__ import annotations


def deterministic_problem(spec: object) -> str | None:
    """The decline reason for a plugin without batch-invariant kernels, when `spec` asks for them."""
    if getattr(spec, "deterministic", False):
        return ("deterministic mode: this plugin's kernels are not batch-invariant; the reference's "
                "invariant variant serves")
    return None
