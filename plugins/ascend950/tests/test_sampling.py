"""AscendSampler: the conformance suite, and seeded draws equal to the reference's, token for token."""

from __future__ import annotations

import dataclasses

import torch
from deepinfer_ascend950.sampling import AscendSampler, probe_device_draw

from deepinfer_core.backends import SamplingSpec
from deepinfer_core.reference.sampling import ReferenceSampler
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import random_sampling_case

CPU = torch.device("cpu")
SPEC = SamplingSpec(vocab_size=300)


def test_conformance():
    conformance.check_sampler(AscendSampler(SPEC, CPU), CPU)


def test_draws_equal_the_reference_on_the_device_and_on_the_host_path():
    logits, params = random_sampling_case(SPEC, seed=3)
    expected = ReferenceSampler(SPEC, CPU).sample(logits, params).token_ids
    on_device = AscendSampler(SPEC, CPU)
    host = AscendSampler(SPEC, CPU)
    host.draws_on_device = False  # what a device that fails the probe uses
    for sampler in (on_device, host):
        for flags in (None, (True, True, True)):
            got = sampler.sample(logits, dataclasses.replace(params, host_flags=flags)).token_ids
            assert torch.equal(got, expected)


def test_the_probe_accepts_the_cpu():
    assert probe_device_draw(CPU) is None
