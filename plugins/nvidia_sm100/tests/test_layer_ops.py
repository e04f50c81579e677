"""The plugin's LayerOps against the reference through the conformance suite (compiled on a GPU,
interpreted by Triton on the CPU)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import LayerOpsSpec
from deepinfer_core.testing import conformance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "hc_mult"), [(32, 4), (48, 3), (64, 1)])
def test_conformance(kernel_device: torch.device, dtype: torch.dtype, hidden: int, hc_mult: int) -> None:
    from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

    spec = LayerOpsSpec(hidden_size=hidden, hc_mult=hc_mult, hc_sinkhorn_iters=20, hc_eps=1e-6,
                        rms_norm_eps=1e-6, dtype=dtype)
    conformance.check_layer_ops(TritonLayerOps(spec, kernel_device), kernel_device)


def test_conformance_at_v4_flash_width(kernel_device: torch.device) -> None:
    from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

    spec = LayerOpsSpec(hidden_size=4096, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                        dtype=torch.bfloat16)
    conformance.check_layer_ops(TritonLayerOps(spec, kernel_device), kernel_device)
