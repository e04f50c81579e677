"""AscendMoE over the torch_npu MoE op doubles: the conformance suite, routing math, constraints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from deepinfer_ascend950.constraints import AscendConstraintError
from deepinfer_ascend950.moe import AscendMoE, combine, routing_weights

from deepinfer_core.backends import MoESpec
from deepinfer_core.reference.moe import route
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import random_moe_case

CPU = torch.device("cpu")
SPEC = MoESpec(hidden_size=64, intermediate_size=32, num_experts=16, top_k=4, scoring_func="sqrtsoftplus",
               routed_scaling_factor=1.5, swiglu_limit=7.0, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("is_hash", [False, True])
def test_conformance_over_the_op_doubles(doubles, dtype, scoring_func, is_hash):
    spec = dataclasses.replace(SPEC, scoring_func=scoring_func, is_hash=is_hash, dtype=dtype)
    conformance.check_moe(AscendMoE(spec, CPU, doubles.torch_npu_module()), CPU, num_tokens_list=(1, 7, 40))


def test_routing_matches_the_reference_ids_and_weights(doubles):
    spec = dataclasses.replace(SPEC, dtype=torch.float32)
    x, input_ids, weights = random_moe_case(spec, 9, seed=4, bias_decides=True)
    backend = AscendMoE(dataclasses.replace(SPEC), CPU, doubles.torch_npu_module())
    ids, w = backend.route(x, input_ids, weights)
    want_ids, want_w = route(x, input_ids, weights, spec)
    order, want_order = ids.long().sort(dim=1), want_ids.sort(dim=1)
    assert torch.equal(order.values, want_order.values) and ids.dtype == torch.int32
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices))


def test_combine_reads_rows_through_expanded_row_idx():
    expert_out = torch.tensor([[1.0], [2.0], [3.0], [4.0]])  # rows in expert order
    # token 0's (k=0, k=1) rows sit at 2 and 0; token 1's at 3 and 1
    out = combine(expert_out, torch.tensor([2, 0, 3, 1], dtype=torch.int32), torch.tensor([[1.0, 10.0], [0.5, 2.0]]))
    assert out.tolist() == [[3.0 + 10.0], [2.0 + 4.0]]


def test_routing_weights_normalise_and_scale():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    w = routing_weights(logits, torch.tensor([[2, 1]], dtype=torch.int32), SPEC)
    assert float(w.sum()) == pytest.approx(SPEC.routed_scaling_factor)


def test_unsupported_specs_name_the_op_and_argument(doubles):
    npu = doubles.torch_npu_module()
    with pytest.raises(AscendConstraintError, match="npu_moe_gating_top_k: x has 4096 experts; at most 2048"):
        AscendMoE(dataclasses.replace(SPEC, num_experts=4096), CPU, npu)
    with pytest.raises(AscendConstraintError, match="npu_grouped_matmul: x/weight dtype is torch.float32"):
        AscendMoE(dataclasses.replace(SPEC, dtype=torch.float32), CPU, npu)
    with pytest.raises(AscendConstraintError, match="norm_type .scoring_func. is 'relu'"):
        AscendMoE(dataclasses.replace(SPEC, scoring_func="relu"), CPU, npu)
    with pytest.raises(AscendConstraintError, match="tid2eid has k=80"):
        AscendMoE(dataclasses.replace(SPEC, num_experts=128, top_k=80, is_hash=True), CPU, npu)
