"""CUDA sampler: conformance, and the same tokens as the reference sampler bit for bit; CUDA only."""

from __future__ import annotations

import torch

from deepinfer_core.backends import SamplingSpec
from deepinfer_core.reference.sampling import ReferenceSampler
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import random_sampling_case


def test_conformance(cuda_device: torch.device) -> None:
    from deepinfer_nvidia_sm100.sampling import CudaSampler

    conformance.check_sampler(CudaSampler(SamplingSpec(vocab_size=5000)), cuda_device)


def test_draws_the_reference_tokens(cuda_device: torch.device) -> None:
    from deepinfer_nvidia_sm100.sampling import CudaSampler

    spec = SamplingSpec(vocab_size=129280)
    logits, params = random_sampling_case(spec, seed=3)
    expected = ReferenceSampler(spec, torch.device("cpu")).sample(logits, params).token_ids
    moved = {
        name: getattr(params, name).to(cuda_device)
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")
    }
    actual = CudaSampler(spec).sample(logits.to(cuda_device), type(params)(**{**params.__dict__, **moved}))
    assert actual.token_ids.cpu().tolist() == expected.tolist()
