"""Sampler on the Ascend 950: the reference's semantics, with its seeded draws reproduced bit for bit.

Masks, logit bias, penalties and the top-k / top-p / min-p filters are the shared PyTorch steps of
`deepinfer_core.backends.sampling_ops`, run on the NPU (vllm-ascend avoids `npu_top_k_top_p` on A5, and its
k <= 1024 limit does not cover the contract). The draw is the reference's counter-based Gumbel-max
(`deepinfer_core.reference.sampling`): SplitMix64 on int64 bit patterns (wrapping multiplication,
logical shifts) and float64 logs. Whether the NPU computes exactly those bits is unknown (Ascend AI
cores have no native float64), so `probe_device_draw` compares a device draw with the CPU's when the
sampler is built: identical, the draw stays on the NPU; otherwise the filtered rows are copied to the
host and drawn there, which reproduces the reference exactly at the cost of one copy per sampled step.
"""

from __future__ import annotations

import logging

import torch

from deepinfer_core.backends.sampling import SamplerOutput, SamplingSpec, SamplingTensors
from deepinfer_core.backends.sampling_ops import (
    adjust_logits,
    check_sampler_inputs,
    filter_sampled,
    sampler_output,
    sampling_flags,
)
from deepinfer_core.reference.sampling import _gumbel_argmax, seeded_uniforms

logger = logging.getLogger(__name__)
PROBE_VOCAB = 4099


def probe_device_draw(device: torch.device) -> str | None:
    """None when `device` computes the reference's seeded uniforms and Gumbel draws bit for bit, else why not."""
    if device.type == "cpu":
        return None
    gen = torch.Generator().manual_seed(7)
    seeds = torch.cat((torch.randint(0, 2**62, (6,), generator=gen), torch.tensor([0, -1, 2**63 - 1])))
    steps = torch.arange(len(seeds), dtype=torch.int64) * 977
    logits = torch.randn(len(seeds), PROBE_VOCAB, generator=gen)
    try:
        uniforms = seeded_uniforms(seeds.to(device), steps.to(device), PROBE_VOCAB).cpu()
        drawn = _gumbel_argmax(logits.to(device), seeds.to(device), steps.to(device)).cpu()
    except (RuntimeError, TypeError) as err:
        return f"the device cannot run the draw ({type(err).__name__}: {err})"
    if not torch.equal(uniforms, seeded_uniforms(seeds, steps, PROBE_VOCAB)):
        return "the device's int64/float64 arithmetic does not reproduce the CPU's seeded uniforms"
    if not torch.equal(drawn, _gumbel_argmax(logits, seeds, steps)):
        return "the device's float64 logs do not reproduce the CPU's Gumbel draws"
    return None


class AscendSampler:
    """`SamplingBackend` for the NPU; draws the reference's tokens (see the module docstring)."""

    def __init__(self, spec: SamplingSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self._probe = probe_device_draw(device)
        self.draws_on_device = self._probe is None
        if self._probe is not None:
            logger.info("seeded draws run on the host: %s", self._probe)

    def host_draw_reason(self) -> str:
        """Why draws run on the host.

        :raises RuntimeError: they do not (the probe passed)."""
        if self._probe is None:
            raise RuntimeError("seeded draws run on the device")
        return self._probe

    def sample(self, logits: torch.Tensor, params: SamplingTensors) -> SamplerOutput:
        check_sampler_inputs(self.spec, logits, params)
        logits = logits.float()
        adjusted = adjust_logits(logits, params)
        token_ids = adjusted.argmax(dim=-1)
        is_sampled = params.temperature > 0
        flags = sampling_flags(params, is_sampled, logits.shape[-1])
        if flags[0]:
            scaled = filter_sampled(adjusted, params, is_sampled, flags)
            token_ids = torch.where(is_sampled, self._draw(scaled, params.seeds, params.steps), token_ids)
        return sampler_output(logits, token_ids, params)

    def _draw(self, scaled: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        if self.draws_on_device:
            return _gumbel_argmax(scaled, seeds, steps)
        return _gumbel_argmax(scaled.cpu(), seeds.cpu(), steps.cpu()).to(scaled.device)
