"""Batch-invariant Triton MoE (deterministic mode): it conforms to the reference, and a token's output is
bit-identical alone and inside batches of other sizes; compiled on a GPU, interpreted by Triton on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.backends import MoESpec
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import random_moe_case

SPEC = MoESpec(hidden_size=64, intermediate_size=32, num_experts=8, top_k=3, scoring_func="sqrtsoftplus",
               routed_scaling_factor=1.5, swiglu_limit=7.0, deterministic=True)


def _backend(spec):
    from deepinfer_nvidia_sm100.invariant_moe import InvariantTritonMoE

    return InvariantTritonMoE(spec)


def _on(device, x, input_ids, weights):
    """The case's tensors on `device` (the kernels take device pointers: a CPU tensor cannot reach a GPU launch)."""
    weights = dataclasses.replace(weights, **{f.name: getattr(weights, f.name).to(device)
                                              for f in dataclasses.fields(weights)
                                              if isinstance(getattr(weights, f.name), torch.Tensor)})
    return x.to(device), input_ids.to(device), weights


def test_conforms_to_the_reference(kernel_device) -> None:
    conformance.check_moe(_backend(SPEC), kernel_device, num_tokens_list=(1, 7, 70))


def test_fp4_experts_conform_to_the_reference(kernel_device) -> None:
    spec = dataclasses.replace(SPEC, expert_format="fp4")
    conformance.check_moe(_backend(spec), kernel_device, num_tokens_list=(1, 5))


@pytest.mark.parametrize("expert_format", ["dense", "fp4"])
def test_token_is_the_same_alone_and_in_batches(kernel_device, expert_format) -> None:
    spec = dataclasses.replace(SPEC, expert_format=expert_format)
    backend = _backend(spec)
    x, input_ids, weights = random_moe_case(spec, 70, seed=4)
    if expert_format == "fp4":
        weights = conformance.fp4_moe_weights(weights)
    x, input_ids, weights = _on(kernel_device, x, input_ids, weights)
    full = backend.forward(x, input_ids, weights)
    for rows in (slice(69, 70), slice(50, 70), slice(0, 70, 3)):
        assert torch.equal(backend.forward(x[rows], input_ids[rows], weights), full[rows])


def test_refuses_other_tiles(kernel_device) -> None:
    from deepinfer_nvidia_sm100.moe import GemmConfig

    x, input_ids, weights = _on(kernel_device, *random_moe_case(SPEC, 2, seed=1))
    ids, topk_weights = _backend(SPEC).route(x, input_ids, weights)
    with pytest.raises(ValueError, match="one tile configuration"):
        _backend(SPEC).experts(x, ids, topk_weights, weights, GemmConfig(64, 64, 64, 4, 4))


def test_v4_flash_shapes_on_gpu(cuda_device) -> None:
    """Compiled kernels at V4-Flash sizes (bf16): a token alone, among 64 and among 2,048 (where default mode
    picks other tiles) gives the same bits."""
    spec = MoESpec(hidden_size=4096, intermediate_size=2048, num_experts=16, top_k=6, scoring_func="sqrtsoftplus",
                   routed_scaling_factor=1.5, swiglu_limit=10.0, dtype=torch.bfloat16, deterministic=True)
    x, input_ids, weights = random_moe_case(spec, 2048, seed=2)
    x, input_ids = x.to(cuda_device, torch.bfloat16), input_ids.to(cuda_device)
    weights = dataclasses.replace(weights, **{
        f.name: getattr(weights, f.name).to(cuda_device, torch.bfloat16 if f.name != "score_bias" else torch.float32)
        for f in dataclasses.fields(weights) if isinstance(getattr(weights, f.name), torch.Tensor)})
    backend = _backend(spec)
    full = backend.forward(x, input_ids, weights)
    for rows in (slice(2047, 2048), slice(1984, 2048)):
        assert torch.equal(backend.forward(x[rows], input_ids[rows], weights), full[rows])
