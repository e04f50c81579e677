"""Which quantised checkpoint tensors stay in their own bytes in memory (`EngineConfig.quantized_weights`).

"native": routed experts stored as packed FP4 (`quantization_config.expert_dtype == "fp4"`) stay packed:
every layer's `MoESpec.expert_format` becomes "fp4", the model holds `layers.FP4Experts`, and the MoE
backend built for that spec reads the packed bytes (the reference dequantises the experts a step uses,
per call; a plugin that cannot read them declines the spec). FP8 weights (dense projections, FP8
experts) have no native path yet and are dequantised at load, which start-up says.
"dequantize": everything quantised is expanded to the compute dtype at load, as before.
Weights handed over in memory (internal names, already dense) always run dense.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.models.layer_plan import LayerPlan

logger = logging.getLogger(__name__)


def expert_format(model_config: ModelConfig, engine_config: EngineConfig, from_checkpoint: bool) -> str:
    """The routed experts' in-memory format: "fp4" (packed) or "dense"."""
    native = engine_config.quantized_weights == "native" and from_checkpoint
    fmt = "fp4" if native and model_config.expert_dtype == "fp4" else "dense"
    quantised = model_config.quantization_config is not None
    if native and quantised:
        logger.info(
            "quantized_weights='native': routed experts %s; FP8 weights are dequantised to the compute "
            "dtype at load (no native FP8 GEMM path yet)",
            "kept in packed FP4" if fmt == "fp4" else f"stored as {model_config.expert_dtype} are dequantised",
        )
    return fmt


def with_expert_format(plans: list[LayerPlan], fmt: str) -> list[LayerPlan]:
    """`plans` with every layer's `MoESpec.expert_format` set to `fmt`."""
    if fmt == "dense":
        return plans
    return [replace(plan, moe=replace(plan.moe, expert_format=fmt)) for plan in plans]
