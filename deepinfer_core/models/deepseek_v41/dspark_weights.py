"""Reading DSpark's `mtp.*` tensors from a DeepSeek-V4.1 checkpoint in the official layout, and building
the `DSparkModule` from them.

The tensors are checked against the release's list (`release.released_tensors`, names, shapes and stored
dtypes) before any is read. As the target's are: FP8 projections kept in their FP8 bytes under
`quantized_weights="native"` (`keep_fp8`; `layers.FP8Linear`, run by the linear backend the drafter binds),
else dequantised to the compute dtype; FP4 routed experts kept packed when the target keeps its own packed
(`keep_fp4`), else dequantised.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

from deepinfer_core.config import CheckpointError
from deepinfer_core.models.deepseek_v41.dspark import DSparkModule
from deepinfer_core.models.deepseek_v41.release import released_tensors
from deepinfer_core.models.deepseek_v41.weights import _experts, _read, _read_fp8
from deepinfer_core.models.loading import weight_formats
from deepinfer_core.models.loading.checkpoint_files import SafetensorsReader, checkpoint_files
from deepinfer_core.models.loading.checkpoint_layout import tensor_schema
from deepinfer_core.models.loading.weights import match_param_dtypes


class DSparkWeightsMissingError(CheckpointError):
    """The checkpoint has no (or incomplete) DSpark `mtp.*` tensors."""


def dspark_tensors(config) -> dict:
    """The release's `mtp.*` tensors for `config`, by name."""
    return {t.name: t for t in released_tensors(config, include_vision=False) if t.name.startswith("mtp.")}


def load_dspark_weights(model_dir, config, dtype: torch.dtype, device, keep_fp4: bool = False,
                        keep_fp8: bool = False) -> dict[str, torch.Tensor]:
    """The drafter's weights (the release's `mtp.*` names; experts stacked as the target's) from `model_dir`;
    with `keep_fp8` every FP8 projection (all the stages' FP8 tensors but the routed experts) stays FP8,
    its block scales as float32 in `<name>_scale` beside it.

    :raises DSparkWeightsMissingError: a DSpark tensor is missing, misshaped or mistyped.
    """
    model_dir = Path(model_dir)
    expected = dspark_tensors(config)
    if not expected:
        raise DSparkWeightsMissingError(f"{model_dir}: its config has no DSpark stages (num_nextn_predict_layers is 0)")
    with ExitStack() as stack:
        reader = SafetensorsReader(checkpoint_files(model_dir), stack)
        _check(reader, expected, model_dir)
        weights = {}
        for name, tensor in expected.items():
            if name.endswith(".scale") or ".experts." in name:
                continue
            if keep_fp8 and tensor.dtype == "F8_E4M3":
                weights.update({key: value.to(device) for key, value in _read_fp8(reader, name).items()})
                continue
            weights[name] = _read(reader, name, tensor.dtype, config, dtype).to(device)
        for stage in range(config.num_nextn_predict_layers):
            weights.update(_experts(reader, config, stage, range(config.dspark_n_routed_experts), dtype, device,
                                    keep_fp4 and config.expert_dtype == "fp4", {}, block="mtp"))
    return weights


def _check(reader: SafetensorsReader, expected: dict, model_dir: Path) -> None:
    names = reader.names
    missing = sorted(n for n in expected if n not in names)
    if missing:
        raise DSparkWeightsMissingError(
            f"{model_dir} has no complete DSpark drafter: {len(missing)} of its mtp.* tensors are missing "
            f"(first: {missing[:5]}); serve it without speculative_config method 'dspark'")
    wrong = [f"{n} has shape {list(reader.shape(n))}, expected {list(t.shape)}"
             for n, t in expected.items() if tuple(reader.shape(n)) != tuple(t.shape)]
    if wrong:
        raise DSparkWeightsMissingError(f"{model_dir}: DSpark tensors do not match its config.json: {'; '.join(wrong[:10])}")


def build_dspark(config, dtype: torch.dtype, weights: dict[str, torch.Tensor], device,
                 expert_format: str = "dense") -> DSparkModule:
    """The `DSparkModule` of `config` holding `weights` (`load_dspark_weights`'s names) on `device`; the
    projections whose weights come with a `<name>_scale` are `FP8Linear`s (the caller binds their backends,
    `weight_formats.bind_linears`)."""
    with torch.device("meta"):
        module = DSparkModule(config, dtype, expert_format)
    weight_formats.hold_fp8_linears(module, weights, config, dtype)
    weights = match_param_dtypes(weights, tensor_schema(module), device)
    module.load_state_dict(weights, strict=True, assign=True)
    return module.eval()
