"""AscendLayerOps over the npu_rms_norm / npu_rotary_mul doubles: the conformance suite and the tables."""

from __future__ import annotations

import pytest
import torch
from deepinfer_ascend950.constraints import AscendConstraintError
from deepinfer_ascend950.layer_ops import AscendLayerOps, interleaved_tables

from deepinfer_core.backends import LayerOpsSpec
from deepinfer_core.reference.layer_ops import apply_rotary
from deepinfer_core.testing import conformance

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conformance_over_the_op_doubles(doubles, dtype):
    spec = LayerOpsSpec(hidden_size=32, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, dtype=dtype)
    conformance.check_layer_ops(AscendLayerOps(spec, doubles.torch_npu_module()), CPU)


def test_interleaved_tables_rotate_the_reference_pairs(doubles):
    angles = torch.rand(3, 4) * 6
    x = torch.randn(3, 2, 8)
    r1, r2 = interleaved_tables(angles.cos(), angles.sin())
    assert r1.shape == (3, 1, 8) and torch.equal(r1[0, 0, 0::2], r1[0, 0, 1::2])
    got = doubles.npu_rotary_mul(x, r1, r2, rotary_mode="interleave")
    torch.testing.assert_close(got, apply_rotary(x, angles.cos(), angles.sin()))


def test_rotary_too_wide_names_the_op(doubles):
    ops = AscendLayerOps(LayerOpsSpec(hidden_size=8, hc_mult=1, hc_sinkhorn_iters=1, hc_eps=1e-6, rms_norm_eps=1e-6),
                         doubles.torch_npu_module())
    with pytest.raises(AscendConstraintError, match="npu_rotary_mul: x rotates 1024 channels; D < 896"):
        ops.rotary(torch.zeros(2, 1024), torch.zeros(2, 512), torch.zeros(2, 512))
