"""Which quantised checkpoint tensors stay in their own bytes in memory (`EngineConfig.quantized_weights`).

"native": routed experts stored as packed FP4 (`quantization_config.expert_dtype == "fp4"`) stay packed:
every layer's `MoESpec.expert_format` becomes "fp4", the model holds `layers.FP4Experts`, and the MoE
backend built for that spec reads the packed bytes (the reference dequantises the experts a step uses,
per call; a plugin that cannot read them declines the spec). Projections (`nn.Linear`, `GroupedLinear`)
whose checkpoint weight is block-scaled FP8 stay FP8: the model holds `layers.FP8Linear` there, run by
the `LinearBackend` of its `LinearSpec` (`bind_linears`; the reference dequantises per call). FP8 routed
experts (`expert_dtype == "fp8"`) and FP8 tensors outside a projection are dequantised at load, which
start-up says.
"dequantize": everything quantised is expanded to the compute dtype at load, as before.
Weights handed over in memory (internal names) run as given: packed FP4 experts (an
`experts.gate_up_proj_scale` beside them, as `load_weights(..., keep_fp4=True)` returns) and FP8
projections (a `<name>.weight_scale` beside the float8_e4m3fn `<name>.weight`, as `load_weights(...,
keep_fp8=...)` returns) stay so under "native" and are dequantised under "dequantize"
(`prepare_weights`); dense ones run dense.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from deepinfer_core.backends import quant
from deepinfer_core.backends.linear import LinearSpec
from deepinfer_core.config import CheckpointError, EngineConfig, ModelConfig
from deepinfer_core.models.deepseek_v4.layers import FP8Linear, GroupedLinear

logger = logging.getLogger(__name__)
_SCALED_EXPERTS = ("experts.gate_up_proj_scale", "experts.down_proj_scale")
_FP8_SCALE = ".weight_scale"


def expert_format(model_config: ModelConfig, engine_config: EngineConfig,
                  weights: dict[str, torch.Tensor] | None = None) -> str:
    """The routed experts' in-memory format, "fp4" (packed) or "dense", for a model loaded from the
    checkpoint (`weights` None) or given `weights`."""
    native = engine_config.quantized_weights == "native"
    packed = model_config.expert_dtype == "fp4" if weights is None else has_packed_experts(weights)
    fmt = "fp4" if native and packed else "dense"
    quantised = model_config.quantization_config is not None
    if native and quantised:
        logger.info(
            "quantized_weights='native': routed experts %s; FP8 projections stay FP8 (start-up names who "
            "runs them)",
            "kept in packed FP4" if fmt == "fp4" else f"stored as {model_config.expert_dtype} are dequantised",
        )
    return fmt


def check_quantization(quantization: str | None, model_config: ModelConfig) -> None:
    """Check vLLM's `quantization` option against the checkpoint: None keeps its own precision; "fp8"
    names the block-FP8 method a quantised checkpoint declares.

    :raises NotImplementedError: for any other method, or "fp8" on an unquantised checkpoint (quantising
        at load, vLLM's online quantisation).
    """
    if quantization is None:
        return
    method = model_config.quantization_config.quant_method if model_config.quantization_config else None
    if quantization == "fp8" and method == "fp8":
        return
    if quantization == "fp8":
        raise NotImplementedError("quantization='fp8' on an unquantised checkpoint (quantising weights at load); "
                                  "leave quantization=None to run the checkpoint at its own precision")
    raise NotImplementedError(f"a quantization other than None or 'fp8': quantization={quantization!r}: only the checkpoint's own precision (None) and "
                              f"its block-FP8 method ('fp8') are implemented")


def has_packed_experts(weights: dict[str, torch.Tensor]) -> bool:
    """Whether `weights` (internal names) hold packed FP4 experts (their `experts.*_scale` beside them)."""
    return any(name.endswith(_SCALED_EXPERTS) for name in weights)


def prepare_weights(weights: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype,
                    keep_fp8: bool = True, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """Given weights in the form the model of format `fmt` holds: packed experts dequantised to `dtype`
    for a dense model, and FP8 projections (`<name>.weight_scale` beside them, tiles of `block`) unless
    `keep_fp8` (a dense model's weights pass through)."""
    if fmt != "fp4" and has_packed_experts(weights):
        dense = {name: t for name, t in weights.items() if not name.endswith(_SCALED_EXPERTS)}
        for name in dense:
            if f"{name}_scale".endswith(_SCALED_EXPERTS) and f"{name}_scale" in weights:
                dense[name] = quant.dequantize_fp4(weights[name], weights[f"{name}_scale"]).to(dtype)
        weights = dense
    if keep_fp8 or not any(name.endswith(_FP8_SCALE) for name in weights):
        return weights
    dense = {name: t for name, t in weights.items() if not name.endswith(_FP8_SCALE)}
    for name in dense:
        if name.endswith(".weight") and f"{name}_scale" in weights:
            dense[name] = quant.dequantize_fp8(weights[name], weights[f"{name}_scale"], block).to(dtype)
    return dense


def fp8_projection_names(model: nn.Module) -> frozenset[str]:
    """The weights of `model`'s projections (`nn.Linear`, `GroupedLinear`; not `lm_head`, whose weight
    the model reads directly) that may stay FP8 under "native" (what `load_weights(..., keep_fp8=...)`
    is given)."""
    return frozenset(f"{name}.weight" for name, module in model.named_modules()
                     if isinstance(module, (nn.Linear, GroupedLinear)) and name != "lm_head")


def fp8_layout(model_config: ModelConfig) -> tuple[tuple[int, int], str]:
    """The checkpoint's FP8 scale tile and scale format ("ue8m0": powers of two, else "float32")."""
    qc = model_config.quantization_config
    if qc is None:
        return (128, 128), "float32"
    return tuple(qc.weight_block_size), "ue8m0" if qc.scale_fmt == "ue8m0" else "float32"


def fp8_linear_specs(model_config: ModelConfig, dtype: torch.dtype) -> list[LinearSpec]:
    """The distinct `LinearSpec`s of the model's projections (but `lm_head`) when its checkpoint is FP8
    (what `deepinfer plugins` asks `make_linear` for); none for an unquantised checkpoint."""
    if model_config.quantization_config is None:
        return []
    from deepinfer_core.models.loading.checkpoint_layout import meta_model

    block, scale_format = fp8_layout(model_config)
    specs = {}
    for name, module in meta_model(model_config, dtype).named_modules():
        if isinstance(module, (nn.Linear, GroupedLinear)) and name != "lm_head":
            out_features, in_features = module.weight.shape
            spec = LinearSpec(in_features=in_features, out_features=out_features,
                              groups=getattr(module, "groups", 1), block=block, scale_format=scale_format, dtype=dtype)
            specs.setdefault(spec, None)
    return list(specs)


def hold_fp8_linears(model: nn.Module, weights: dict[str, torch.Tensor], model_config: ModelConfig,
                     dtype: torch.dtype) -> list[str]:
    """Replace every projection of `model` (built on the meta device) whose weight comes with a
    `<name>.weight_scale` in `weights` by an `FP8Linear` of the same shape; return their module names."""
    block, scale_format = fp8_layout(model_config)
    replaced = []
    for name, module in list(model.named_modules()):
        if f"{name}.weight_scale" not in weights:
            continue
        if not isinstance(module, (nn.Linear, GroupedLinear)):
            raise CheckpointError(f"{name}.weight_scale: {name} is a {type(module).__name__}, not a projection "
                                  "that can stay FP8; load with quantized_weights='dequantize'")
        out_features, in_features = module.weight.shape
        spec = LinearSpec(in_features=in_features, out_features=out_features, groups=getattr(module, "groups", 1),
                          block=block, scale_format=scale_format, dtype=dtype)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, FP8Linear(spec))
        replaced.append(name)
    return replaced


def bind_linears(model: nn.Module, make_linear: Callable[[LinearSpec, torch.device], object],
                 device: torch.device) -> list[object]:
    """Give every `FP8Linear` of `model` the backend `make_linear` builds for its spec (one per distinct
    spec), say at start-up which backend runs them, and return the backends."""
    backends: dict[LinearSpec, object] = {}
    count = 0
    for module in model.modules():
        if isinstance(module, FP8Linear):
            if module.spec not in backends:
                backends[module.spec] = make_linear(module.spec, device)
            module.backend = backends[module.spec]
            count += 1
    if not backends:
        return []
    names = sorted({type(backend).__qualname__ for backend in backends.values()})
    logger.info("FP8 projections: %d (%d kinds) kept in FP8, run by %s", count, len(backends), ", ".join(names))
    if device.type != "cpu" and any(type(b).__qualname__ == "ReferenceLinear" for b in backends.values()):
        logger.warning(
            "no plugin offers an FP8 GEMM for some projections on %s: the reference dequantises those weights "
            "on every call (slow); quantized_weights='dequantize' expands them once at load instead", device)
    return list(backends.values())
