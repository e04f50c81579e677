"""Which quantised checkpoint tensors stay in their own bytes in memory (`EngineConfig.quantized_weights`).

"native": routed experts stored as packed FP4 (`quantization_config.expert_dtype == "fp4"`) stay packed:
every layer's `MoESpec.expert_format` becomes "fp4", the model holds `layers.FP4Experts`, and the MoE
backend built for that spec reads the packed bytes (the reference dequantises the experts a step uses,
per call; a plugin that cannot read them declines the spec). FP8 weights (dense projections, FP8
experts) have no native path yet and are dequantised at load, which start-up says.
"dequantize": everything quantised is expanded to the compute dtype at load, as before.
Weights handed over in memory (internal names) run as given: packed FP4 experts (an
`experts.gate_up_proj_scale` beside them, as `load_weights(..., keep_fp4=True)` returns) stay packed under
"native" and are dequantised under "dequantize" (`prepare_weights`); dense ones run dense.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.models import quant
from deepinfer_core.models.layer_plan import LayerPlan

logger = logging.getLogger(__name__)
_SCALED_EXPERTS = ("experts.gate_up_proj_scale", "experts.down_proj_scale")


def expert_format(model_config: ModelConfig, engine_config: EngineConfig,
                  weights: dict[str, torch.Tensor] | None = None) -> str:
    """The routed experts' in-memory format, "fp4" (packed) or "dense", for a model loaded from the
    checkpoint (`weights` None) or given `weights`."""
    native = engine_config.quantized_weights == "native"
    packed = model_config.expert_dtype == "fp4" if weights is None else _has_packed_experts(weights)
    fmt = "fp4" if native and packed else "dense"
    quantised = model_config.quantization_config is not None
    if native and quantised:
        logger.info(
            "quantized_weights='native': routed experts %s; FP8 weights are dequantised to the compute "
            "dtype at load (no native FP8 GEMM path yet)",
            "kept in packed FP4" if fmt == "fp4" else f"stored as {model_config.expert_dtype} are dequantised",
        )
    return fmt


def _has_packed_experts(weights: dict[str, torch.Tensor]) -> bool:
    return any(name.endswith(_SCALED_EXPERTS) for name in weights)


def prepare_weights(weights: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Given weights in the form the model of format `fmt` holds: packed experts dequantised to `dtype`
    for a dense model (a dense model's weights pass through)."""
    if fmt == "fp4" or not _has_packed_experts(weights):
        return weights
    dense = {name: t for name, t in weights.items() if not name.endswith(_SCALED_EXPERTS)}
    for name in dense:
        if f"{name}_scale" in weights:
            dense[name] = quant.dequantize_fp4(weights[name], weights[f"{name}_scale"]).to(dtype)
    return dense


def with_expert_format(plans: list[LayerPlan], fmt: str) -> list[LayerPlan]:
    """`plans` with every layer's `MoESpec.expert_format` set to `fmt`."""
    if fmt == "dense":
        return plans
    return [replace(plan, moe=replace(plan.moe, expert_format=fmt)) for plan in plans]
