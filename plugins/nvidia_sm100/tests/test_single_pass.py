"""V4.1's single-pass mHC boundaries on the V4 boundary kernels against `ReferenceLayerOps`' (compiled on a
GPU, else in Triton's interpreter): every launch path, a strided `pre` handed on, V4.1-Flash's sizes."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import SinglePassMixing
from deepinfer_core.reference.layer_ops import ReferenceLayerOps
from plugins.nvidia_sm100.tests.test_hyper_kernels import (  # noqa: F401 (the autouse fixture)
    CASES,
    DTYPES,
    assert_matches,
    make_case,
    poisoned_allocations,
)


@pytest.fixture
def single_pass(kernel_device: torch.device):
    from deepinfer_nvidia_sm100 import single_pass

    return single_pass


def collapse_pre(num_tokens: int, n: int, device, seed: int = 3) -> torch.Tensor:
    """A previous site's `pre`: positive weights, far from the ones this site works out."""
    return (0.1 + torch.rand(num_tokens, n, generator=torch.Generator().manual_seed(seed))).to(device)


def check(outputs, expected, dtype) -> None:
    assert len(outputs) == len(expected)
    for actual, ref in zip(outputs, expected, strict=True):
        assert_matches(actual, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp32: hc_post_mix's cases
@pytest.mark.parametrize(("n", "num_tokens", "hidden", "expanded"), CASES)
def test_hc_mix_matches_reference(single_pass, kernel_device, dtype, n, num_tokens, hidden, expanded):
    spec, hc, _, inputs = make_case(kernel_device, n, num_tokens, hidden, dtype, expanded)
    given = collapse_pre(num_tokens, n, kernel_device)
    outputs = single_pass.hc_mix(inputs["streams"], hc, inputs["norm_weight"], given, spec)
    expected = ReferenceLayerOps(spec).hc_mix(inputs["streams"], hc, inputs["norm_weight"], given)
    check(outputs, expected, dtype)
    if n > 1 and not expanded:  # the collapse used the given pre, not its own (equal streams: the same)
        own = ReferenceLayerOps(spec).hc_pre(inputs["streams"], hc, inputs["norm_weight"])[2]
        assert (own.float() - expected[3].float()).abs().max() > 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "num_tokens", "hidden", "expanded"), CASES)
def test_hc_post_mix_matches_reference(single_pass, kernel_device, dtype, n, num_tokens, hidden, expanded):
    spec, hc, _, inputs = make_case(kernel_device, n, num_tokens, hidden, dtype, expanded)
    given = collapse_pre(num_tokens, n, kernel_device)
    args = (inputs["streams"], inputs["block_out"], inputs["post"], inputs["comb"], hc, inputs["norm_weight"], given)
    outputs = single_pass.hc_post_mix(*args, spec)
    assert outputs[0].is_contiguous()
    check(outputs, ReferenceLayerOps(spec).hc_post_mix(*args), dtype)


@pytest.mark.parametrize("two_pass", [False, True])
def test_a_chain_of_boundaries_hands_each_pre_on(single_pass, kernel_device, monkeypatch, two_pass):
    """The model's chain: the one-hot first `pre`, then each boundary collapses with the `pre` (a strided
    view of the kernel's scratch) the one before returned; one launch and the two-pass path."""
    from deepinfer_nvidia_sm100 import hyper_kernels

    if two_pass:
        monkeypatch.setattr(hyper_kernels, "TWO_PASS_MIN_ROWS", 1)
        monkeypatch.setattr(hyper_kernels, "BLOCK_TOKENS", ((1 << 30, 16),))
    spec, hc, _, inputs = make_case(kernel_device, 4, 17, 32, torch.float32, seed=4)
    ref = ReferenceLayerOps(spec)
    pre = torch.zeros(17, 4, device=kernel_device)
    pre[:, 0] = 1.0
    mine = ref_state = (inputs["streams"], pre)
    *_, x = single_pass.hc_mix(inputs["streams"], hc, inputs["norm_weight"], pre, spec)
    for step in range(3):
        out = inputs["block_out"] * (step + 1)
        post, comb = inputs["post"], inputs["comb"]
        new, pre_k, _, _, x = single_pass.hc_post_mix(mine[0], out, post, comb, hc, inputs["norm_weight"], mine[1], spec)
        ref_new, ref_pre, _, _, ref_x = ref.hc_post_mix(ref_state[0], out, post, comb, hc, inputs["norm_weight"],
                                                       ref_state[1])
        assert_matches(x, ref_x, torch.float32)
        assert_matches(pre_k, ref_pre, torch.float32)
        mine, ref_state = (new, pre_k), (ref_new, ref_pre)


def test_v41_flash_shapes(single_pass, cuda_device):
    """hidden 5120, four streams, bf16: a two-token decode boundary (on a GPU)."""
    spec, hc, _, inputs = make_case(cuda_device, 4, 2, 5120, torch.bfloat16, seed=1)
    given = collapse_pre(2, 4, cuda_device)
    args = (inputs["streams"], inputs["block_out"], inputs["post"], inputs["comb"], hc, inputs["norm_weight"], given)
    check(single_pass.hc_post_mix(*args, spec), ReferenceLayerOps(spec).hc_post_mix(*args), torch.bfloat16)


def test_the_triton_layer_ops_serve_the_single_pass(kernel_device):
    from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

    spec, hc, _, inputs = make_case(kernel_device, 2, 3, 32, torch.float32)
    ops = TritonLayerOps(spec, kernel_device)
    assert isinstance(ops, SinglePassMixing) and isinstance(ReferenceLayerOps(spec), SinglePassMixing)
    given = collapse_pre(3, 2, kernel_device)
    check(ops.hc_mix(inputs["streams"], hc, inputs["norm_weight"], given),
          ReferenceLayerOps(spec).hc_mix(inputs["streams"], hc, inputs["norm_weight"], given), torch.float32)
