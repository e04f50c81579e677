"""Reading the MTP layer's tensors (`mtp.*`) from a checkpoint, in any of the three layouts, quantised or not.

- "hf" (internal names): `mtp.0.self_attn.q_a_proj.weight`, `mtp.0.enorm.weight`, ...
- "official" (DeepSeek's release): the per-layer names of `checkpoint_layout` under `mtp.0.`
  (`mtp.0.attn.wq_a.weight`, `mtp.0.ffn.experts.E.w1.weight`, ...) plus `mtp.0.enorm.weight`,
  `mtp.0.hnorm.weight`, `mtp.0.e_proj.weight`, `mtp.0.h_proj.weight`, `mtp.0.hc_head_fn` / `_base` /
  `_scale` and `mtp.0.norm.weight`;
- "transformers": the official names under `model.` (its `kv_norm` spelled `norm`, as for the layers).

The names come from `checkpoint_layout.mtp_source_plans` and the tensors are read by the model's own
reader (`weights.read_plans`), so the MTP layer's tensors are checked, dequantised or kept exactly as
the layers' are: FP8 e4m3 with block scales (`.scale` / `_scale_inv`, float32 or UE8M0) and packed FP4
routed experts with per-32 scales (`quantization_config.expert_dtype == "fp4"`). With `keep_fp4` the
experts stay packed and with `keep_fp8` the projections stored as FP8 stay FP8 (`<name>_scale` beside
them), as the target's do under `quantized_weights="native"`; everything else quantised is dequantised
to the dtype its module declares.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from deepinfer_core.config import CheckpointError, ModelConfig
from deepinfer_core.models.deepseek_v4.mtp import MTPWeightsMissingError, MultiTokenPredictor
from deepinfer_core.models.loading import weight_formats
from deepinfer_core.models.loading.checkpoint_files import checkpoint_files
from deepinfer_core.models.loading.checkpoint_layout import detect_layout, mtp_source_plans, tensor_schema
from deepinfer_core.models.loading.weight_formats import fp8_projection_names
from deepinfer_core.models.loading.weights import match_param_dtypes, read_plans
from deepinfer_core.models.tensor_parallel import mtp_tensor_shards

_MTP_NAME = re.compile(r"(?:model\.)?mtp\.(\d+)\..+")


def num_mtp_layers(names) -> int:
    """How many MTP layers the checkpoint tensor `names` hold (the highest `mtp.<i>.` plus one; 0: none)."""
    indices = [int(match.group(1)) for name in names if (match := _MTP_NAME.fullmatch(name)) is not None]
    return max(indices) + 1 if indices else 0


def load_mtp_weights(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", *, keep_fp4: bool = False, keep_fp8: bool = False,
    progress: bool | None = None, tp_rank: int = 0, tp_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The checkpoint's MTP tensors in the `MultiTokenPredictor`'s names (`0.self_attn.q_a_proj.weight`,
    no `mtp.` prefix) on `device`; empty when it has none, or no safetensors file at all.

    `keep_fp4`: routed experts stored as packed FP4 stay packed (`<name>_scale` the e8m0 scales);
    `keep_fp8`: projections stored as block-scaled FP8 stay so (`<name>_scale` float32), as
    `weights.load_weights` returns them for the model's layers. With `tp_size > 1` only tensor-parallel
    rank `tp_rank`'s slices of the cut tensors are read (`tensor_parallel.mtp_tensor_shards`; a cut FP8
    projection comes back dequantised, as the target's do).

    :raises CheckpointError: missing, unexpected, misshaped or mistyped MTP tensors or scales (named),
        or tensors holding NaN / Inf.
    """
    model_dir = Path(model_dir)
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.safetensors.index.json")):
        return {}
    files = checkpoint_files(model_dir)
    num_layers = num_mtp_layers(files)
    if not num_layers:
        return {}
    layout = detect_layout(list(files))
    with torch.device("meta"):
        module = MultiTokenPredictor(config, dtype, num_layers)
    keep = fp8_projection_names(module) if keep_fp8 else frozenset()
    schema = tensor_schema(module)
    return read_plans(model_dir, files, layout, mtp_source_plans(config, layout, num_layers), config,
                      schema, device, progress, keep_fp4=keep_fp4, keep_fp8=keep, is_mtp=True,
                      shards=mtp_tensor_shards(schema, tp_rank, tp_size))


def build_mtp(config, dtype: torch.dtype, weights: dict[str, torch.Tensor], device: torch.device,
              source: str, *, keep_fp4: bool = False, keep_fp8: bool = False) -> MultiTokenPredictor:
    """The MTP module of `config` loaded from `weights` (internal names without `mtp.`), holding them as
    the target holds its layers': with `keep_fp4`, packed FP4 experts (an `experts.*_scale` beside them)
    stay packed, and with `keep_fp8`, FP8 projections (a `<name>_scale` beside the `<name>` weight) stay
    FP8 (`FP8Linear`, bound to a `LinearBackend` by the caller); otherwise they are dequantised to `dtype`.

    :raises MTPWeightsMissingError: `weights` holds no MTP tensor.
    :raises CheckpointError: missing, unexpected or misshaped tensors, named.
    """
    if not weights:
        raise MTPWeightsMissingError(
            f"speculative_config method 'mtp' needs the checkpoint's multi-token-prediction weights (mtp.0.*), "
            f"but {source} has none (num_nextn_predict_layers={config.num_nextn_predict_layers}); use method "
            "'ngram', or a checkpoint that ships its MTP layer")
    num_layers = len({name.split(".", 1)[0] for name in weights})
    fmt = "fp4" if keep_fp4 and weight_formats.has_packed_experts(weights) else "dense"
    weights = weight_formats.prepare_weights(weights, fmt, dtype, keep_fp8=keep_fp8,
                                             block=weight_formats.fp8_layout(config)[0])
    with torch.device("meta"):
        module = MultiTokenPredictor(config, dtype, num_layers, fmt)
    weight_formats.hold_fp8_linears(module, weights, config, dtype)
    expected = tensor_schema(module)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    misshaped = sorted(n for n in set(expected) & set(weights) if tuple(weights[n].shape) != expected[n].shape)
    if missing or unexpected or misshaped:
        raise CheckpointError(f"MTP weights of {source} do not fit the model: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}, misshaped {misshaped[:5]} (names under 'mtp.')")
    module.load_state_dict(match_param_dtypes(weights, expected, device), strict=True, assign=True)
    return module.eval()
