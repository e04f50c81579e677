"""CUDA sampler: conformance, and the same tokens as the reference sampler bit for bit (compiled on a GPU,
interpreted by Triton on the CPU)."""

from __future__ import annotations

import torch

from deepinfer_core.backends import SamplingSpec
from deepinfer_core.reference.sampling import ReferenceSampler
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import random_sampling_case


def test_conformance(kernel_device: torch.device) -> None:
    from deepinfer_nvidia_sm100.sampling import CudaSampler

    conformance.check_sampler(CudaSampler(SamplingSpec(vocab_size=5000)), kernel_device)


def test_draws_the_reference_tokens(kernel_device: torch.device) -> None:
    from deepinfer_nvidia_sm100.sampling import CudaSampler

    spec = SamplingSpec(vocab_size=129280 if kernel_device.type == "cuda" else 8192)
    logits, params = random_sampling_case(spec, seed=3)
    expected = ReferenceSampler(spec, torch.device("cpu")).sample(logits, params).token_ids
    moved = {
        name: getattr(params, name).to(kernel_device)
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")
    }
    actual = CudaSampler(spec).sample(logits.to(kernel_device), type(params)(**{**params.__dict__, **moved}))
    assert actual.token_ids.cpu().tolist() == expected.tolist()


def test_host_flags_choose_the_same_passes(kernel_device: torch.device) -> None:
    from deepinfer_nvidia_sm100.sampling import CudaSampler

    spec = SamplingSpec(vocab_size=4096)
    logits, params = random_sampling_case(spec, seed=5)
    moved = {name: getattr(params, name).to(kernel_device)
             for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")}
    sampler = CudaSampler(spec)
    on_device = type(params)(**{**params.__dict__, **moved, "host_flags": None})
    is_sampled = params.temperature > 0
    flags = (bool(is_sampled.any()), bool((is_sampled & ((params.top_k > 0) | (params.top_p < 1))).any()),
             bool((is_sampled & (params.min_p > 0)).any()))
    assert flags == (True, True, True)  # the case exercises every pass
    from_host = type(params)(**{**on_device.__dict__, "host_flags": flags})
    expected = sampler.sample(logits.to(kernel_device), on_device)
    actual = sampler.sample(logits.to(kernel_device), from_host)
    assert actual.token_ids.tolist() == expected.token_ids.tolist()
    torch.testing.assert_close(actual.logprobs, expected.logprobs)
