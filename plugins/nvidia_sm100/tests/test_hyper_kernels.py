"""mHC kernels against `ReferenceLayerOps`: compiled on a GPU, else in Triton's interpreter."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.backends.layer_ops import HyperWeights, LayerOpsSpec
from deepinfer_core.reference.layer_ops import ReferenceLayerOps

# (hc_mult, num_tokens, hidden, expanded streams): together they take every kernel path on the CPU and
# on a GPU, one token or 16 per program, with and without splitting the hidden dim
CASES = [(1, 1, 96, True), (2, 3, 32, False), (3, 17, 96, True), (1, 40, 32, False), (4, 3, 96, False),
         (2, 40, 96, True)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def kernels(kernel_device: torch.device):
    from deepinfer_nvidia_sm100 import hyper_kernels

    return hyper_kernels


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs and scratch come from `new_empty`: fill them with NaN so a value never written shows."""
    new_empty = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        out = new_empty(self, *args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)


def make_case(device, n, num_tokens, hidden, dtype, expanded=False, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def weights(num_rows, num_scales):
        # rows of about unit norm against the rms-normalised streams, scales of 1-3: the softmax and the
        # Sinkhorn see logits spread over several units
        fn = randn(num_rows, n * hidden) * (2 / math.sqrt(n * hidden))
        return HyperWeights(fn=fn.to(device), base=randn(num_rows).to(device),
                            scale=(1 + 2 * torch.rand(num_scales, generator=gen)).to(device))

    spec = LayerOpsSpec(hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                        dtype=dtype)
    if expanded:
        streams = randn(num_tokens, hidden).to(dtype).to(device).unsqueeze(1).expand(-1, n, -1)
    else:
        streams = (randn(num_tokens, n, hidden) * (1 + torch.arange(n)).view(1, n, 1)).to(dtype).to(device)
    inputs = {
        "streams": streams,
        "block_out": randn(num_tokens, hidden).to(dtype).to(device),
        "post": (2 * torch.rand(num_tokens, n, generator=gen)).to(device),
        "comb": torch.softmax(randn(num_tokens, n, n), dim=-1).to(device),
        "norm_weight": (0.5 + torch.rand(hidden, generator=gen)).to(device),
    }
    return spec, weights((2 + n) * n, 3), weights(n, 1), inputs


def assert_matches(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32 and dtype == torch.bfloat16:
        tol = {"rtol": 1e-3, "atol": 1e-4}  # mixing weights: fp32 math on the same bf16 streams
    elif expected.dtype == torch.bfloat16:
        tol = {"rtol": 2e-2, "atol": 2e-2}  # a bf16 ulp or two
    else:
        tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(actual, expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "num_tokens", "hidden", "expanded"), CASES)
def test_hc_pre_matches_reference(kernels, kernel_device, dtype, n, num_tokens, hidden, expanded):
    spec, hc, _, inputs = make_case(kernel_device, n, num_tokens, hidden, dtype, expanded)
    post, comb, x = kernels.hc_pre(inputs["streams"], hc, inputs["norm_weight"], spec)
    ref_post, ref_comb, ref_x = ReferenceLayerOps(spec).hc_pre(inputs["streams"], hc, inputs["norm_weight"])
    if n > 1:  # the case is informative: comb is far from uniform
        assert (ref_comb.amax(-1) - ref_comb.amin(-1)).mean() > 0.2
    assert_matches(post, ref_post, dtype)
    assert_matches(comb, ref_comb, dtype)
    assert_matches(x, ref_x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "num_tokens", "hidden", "expanded"), CASES)
def test_hc_post_pre_matches_reference(kernels, kernel_device, dtype, n, num_tokens, hidden, expanded):
    spec, hc, _, inputs = make_case(kernel_device, n, num_tokens, hidden, dtype, expanded)
    args = (inputs["streams"], inputs["block_out"], inputs["post"], inputs["comb"], hc, inputs["norm_weight"])
    outputs = kernels.hc_post_pre(*args, spec)
    expected = ReferenceLayerOps(spec).hc_post_pre(*args)
    assert outputs[0].is_contiguous()
    for actual, ref in zip(outputs, expected, strict=True):
        assert_matches(actual, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "num_tokens", "hidden", "expanded"), CASES)
def test_hc_post_head_matches_reference(kernels, kernel_device, dtype, n, num_tokens, hidden, expanded):
    spec, _, head, inputs = make_case(kernel_device, n, num_tokens, hidden, dtype, expanded)
    streams = inputs["streams"]
    rows = torch.arange(num_tokens - 1, -1, -2, device=kernel_device)  # every other token, last first
    args = (streams, inputs["block_out"], inputs["post"], inputs["comb"], rows, head, inputs["norm_weight"])
    assert_matches(kernels.hc_post_head(*args, spec), ReferenceLayerOps(spec).hc_post_head(*args), dtype)


def test_v4_flash_shapes(kernels, kernel_device):
    """hidden 4096, four streams, bf16: the block boundary and the head of a two-token decode."""
    spec, hc, head, inputs = make_case(kernel_device, 4, 2, 4096, torch.bfloat16, seed=1)
    ref = ReferenceLayerOps(spec)
    args = (inputs["streams"], inputs["block_out"], inputs["post"], inputs["comb"])
    for actual, expected in zip(kernels.hc_post_pre(*args, hc, inputs["norm_weight"], spec),
                                ref.hc_post_pre(*args, hc, inputs["norm_weight"]), strict=True):
        assert_matches(actual, expected, torch.bfloat16)
    rows = torch.tensor([1], device=kernel_device)
    assert_matches(kernels.hc_post_head(*args, rows, head, inputs["norm_weight"], spec),
                   ref.hc_post_head(*args, rows, head, inputs["norm_weight"]), torch.bfloat16)


def test_cases_cover_every_kernel_path(kernels, kernel_device):
    """Programs of one token and of several, with and without splits of the hidden dim (several tokens and
    splits: `test_every_block_size`)."""
    plans = [kernels.launch_plan(num_tokens, n, hidden, False, kernel_device)
             for n, num_tokens, hidden, _ in CASES]
    assert {(plan.block_tokens > 1, plan.num_splits > 1) for plan in plans} >= {
        (False, False), (False, True), (True, False)}


@pytest.mark.parametrize("block_tokens", [2, 8, 16, 64])
def test_every_block_size(kernels, kernel_device, monkeypatch, block_tokens):
    """Several tokens a program (16: the tl.dot path), a ragged last block, the fold and the head."""
    monkeypatch.setattr(kernels, "BLOCK_TOKENS", ((1 << 30, block_tokens),))
    spec, hc, head, inputs = make_case(kernel_device, 3, 19, 96, torch.bfloat16)
    plan = kernels.launch_plan(19, 3, 96, False, kernel_device)
    assert plan.block_tokens == block_tokens
    assert block_tokens < 16 or plan.num_splits > 1
    ref = ReferenceLayerOps(spec)
    args = (inputs["streams"], inputs["block_out"], inputs["post"], inputs["comb"])
    for actual, expected in zip(kernels.hc_post_pre(*args, hc, inputs["norm_weight"], spec),
                                ref.hc_post_pre(*args, hc, inputs["norm_weight"]), strict=True):
        assert_matches(actual, expected, torch.bfloat16)
    rows = torch.arange(18, -1, -1, device=kernel_device)
    assert_matches(kernels.hc_post_head(*args, rows, head, inputs["norm_weight"], spec),
                   ref.hc_post_head(*args, rows, head, inputs["norm_weight"]), torch.bfloat16)


def test_split_counters_are_left_zeroed_and_results_repeat(kernels, kernel_device):
    spec, hc, _, inputs = make_case(kernel_device, 4, 1, 96, torch.float32)
    assert kernels.launch_plan(1, 4, 96, False, kernel_device).num_splits > 1
    counters = kernels.new_split_counters(kernel_device)
    first = kernels.hc_pre(inputs["streams"], hc, inputs["norm_weight"], spec, counters=counters)
    assert not counters.any()
    second = kernels.hc_pre(inputs["streams"], hc, inputs["norm_weight"], spec, counters=counters)
    assert not counters.any()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)  # partial sums are added in split order, not arrival order


def test_bad_shapes_raise(kernels, kernel_device):
    spec, hc, head, inputs = make_case(kernel_device, 2, 3, 32, torch.float32)
    with pytest.raises(ValueError, match="hc_mult"):
        kernels.hc_pre(inputs["streams"][:, :1], hc, inputs["norm_weight"], spec)
    with pytest.raises(ValueError, match="block mHC fn"):
        kernels.hc_pre(inputs["streams"], head, inputs["norm_weight"], spec)


@pytest.mark.parametrize("tensor_core_dot", [True, False])
@pytest.mark.parametrize(("block_tokens", "n", "num_tokens", "hidden"),
                         [(16, 3, 19, 96), (16, 4, 40, 32), (64, 2, 70, 160), (2, 4, 9, 96)])
def test_two_pass(kernels, kernel_device, monkeypatch, tensor_core_dot, block_tokens, n, num_tokens, hidden):
    """Many tokens: phase 1 in one launch (one split or several), phases 2-4 in a second."""
    monkeypatch.setattr(kernels, "TWO_PASS_MIN_ROWS", 1)
    monkeypatch.setattr(kernels, "BLOCK_TOKENS", ((1 << 30, block_tokens),))
    monkeypatch.setattr(kernels, "TENSOR_CORE_DOT", tensor_core_dot)
    plan = kernels.launch_plan(num_tokens, n, hidden, False, kernel_device)
    assert plan.two_pass and plan.split_dot == (tensor_core_dot and block_tokens >= 16)
    spec, hc, head, inputs = make_case(kernel_device, n, num_tokens, hidden, torch.bfloat16, seed=2)
    ref = ReferenceLayerOps(spec)
    for actual, expected in zip(kernels.hc_pre(inputs["streams"], hc, inputs["norm_weight"], spec),
                                ref.hc_pre(inputs["streams"], hc, inputs["norm_weight"]), strict=True):
        assert_matches(actual, expected, torch.bfloat16)
    args = (inputs["streams"], inputs["block_out"], inputs["post"], inputs["comb"])
    for actual, expected in zip(kernels.hc_post_pre(*args, hc, inputs["norm_weight"], spec),
                                ref.hc_post_pre(*args, hc, inputs["norm_weight"]), strict=True):
        assert_matches(actual, expected, torch.bfloat16)
    rows = torch.arange(num_tokens - 1, -1, -3, device=kernel_device)
    assert_matches(kernels.hc_post_head(*args, rows, head, inputs["norm_weight"], spec),
                   ref.hc_post_head(*args, rows, head, inputs["norm_weight"]), torch.bfloat16)


def test_two_pass_plans(kernels, kernel_device):
    """V4-Flash sizes: one launch up to `TWO_PASS_MIN_ROWS`, then two; on a GPU phase 1 has several
    splits (the interpreter's target is 4 programs, which 128 token blocks already exceed)."""
    assert not kernels.launch_plan(kernels.TWO_PASS_MIN_ROWS - 1, 4, 4096, False, kernel_device).two_pass
    plan = kernels.launch_plan(8192, 4, 4096, False, kernel_device)
    assert plan.two_pass and plan.block_tokens == 64 and plan.split_dot
    assert plan.num_splits > 1 if kernel_device.type == "cuda" else plan.num_splits == 1
    assert plan.num_splits * plan.chunks_per_split * plan.block_d >= 4096
