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


def test_logit_adjustments_draw_the_reference_tokens(kernel_device: torch.device) -> None:
    """Penalties, logit bias, allowed ids and bad words, greedy and drawn, through the Triton draw."""
    from deepinfer_nvidia_sm100.sampling import CudaSampler

    from deepinfer_core.backends.sampling_tensors import prepare_sampling_tensors
    from deepinfer_core.sampling_params import SamplingParams

    vocab = 4096
    spec = SamplingSpec(vocab_size=vocab)
    rows = [
        SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.7),
        SamplingParams(temperature=0.9, presence_penalty=-0.5, repetition_penalty=0.8, top_k=50, seed=1),
        SamplingParams(temperature=1.1, logit_bias={7: 30.0, 9: -100.0}, top_p=0.8, seed=2),
        SamplingParams(temperature=0.7, allowed_token_ids=[3, 11, 4000], min_p=0.1, seed=3),
        SamplingParams(temperature=0, logit_bias={5: 100.0}),
        SamplingParams(temperature=1.0, frequency_penalty=2.0, seed=4),
    ]
    rows[2].bad_words_token_ids = [[7], [1, 2, 8]]
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(len(rows), vocab, generator=generator) * 3
    outputs = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (9, 3, 4, 0, 2, 30)]
    outputs[2][-2:] = [1, 2]  # bad word [1, 2, 8] bans 8 next
    outputs[0] += [int(logits[0].argmax())] * 3  # the greedy row's favourite, penalised away
    prompts = [torch.randint(0, vocab, (5,), generator=generator).tolist() for _ in rows]

    def tensors(device: torch.device):
        return prepare_sampling_tensors(rows, [p.seed or 0 for p in rows], [len(o) for o in outputs], [1], device,
                                        vocab, output_token_ids=outputs, prompt_token_ids=prompts)

    expected = ReferenceSampler(spec, torch.device("cpu")).sample(logits, tensors(torch.device("cpu")))
    actual = CudaSampler(spec).sample(logits.to(kernel_device), tensors(kernel_device))
    assert actual.token_ids.cpu().tolist() == expected.token_ids.tolist()
    assert expected.token_ids[0] != logits[0].argmax() and expected.token_ids[4] == 5
    assert expected.token_ids[3] in (3, 11, 4000) and expected.token_ids[2] not in (7, 8)


def test_log_softmax_kernel_is_batch_invariant_and_close_to_torch(kernel_device: torch.device) -> None:
    """One program a row with a fixed reduction order (deterministic mode): a row's logprobs are the same bits
    alone and at any place in batches of any size, at V4's full vocabulary."""
    from deepinfer_nvidia_sm100.sampling import log_softmax

    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(10, 129280, generator=generator) * 6  # the interpreter runs the programs one by one
    logits[3, ::7] = float("-inf")  # masked ids
    logits[5] += 90.0  # far from zero: the max shift matters
    logits = logits.to(kernel_device)
    alone = {row: log_softmax(logits[row : row + 1])[0] for row in (3, 5)}
    whole = log_softmax(logits)
    for first, last in ((0, 6), (0, 10), (3, 9), (5, 6)):
        out = whole if (first, last) == (0, 10) else log_softmax(logits[first:last])
        for row, expected in alone.items():
            if first <= row < last:
                assert torch.equal(out[row - first], expected)
    torch.testing.assert_close(whole.cpu(), torch.log_softmax(logits.cpu(), dim=-1), atol=2e-5, rtol=0)


def test_a_deterministic_sampler_returns_a_rows_logprobs_whatever_its_batch(kernel_device: torch.device) -> None:
    from deepinfer_nvidia_sm100.sampling import CudaSampler, log_softmax

    spec = SamplingSpec(vocab_size=4096, deterministic=True)
    logits, params = random_sampling_case(spec, seed=3)
    moved = {name: getattr(params, name).to(kernel_device)
             for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")}
    batch = CudaSampler(spec).sample(logits.to(kernel_device), type(params)(**{**params.__dict__, **moved}))
    expected = log_softmax(logits.to(kernel_device))
    assert torch.equal(batch.logprobs, expected.gather(1, batch.token_ids[:, None]).squeeze(1))
    one = type(params)(**{**params.__dict__, **{name: t[:1] for name, t in moved.items()}, "banned_token_ids": None})
    alone = CudaSampler(spec).sample(logits[:1].to(kernel_device), one)
    assert torch.equal(alone.logprobs, batch.logprobs[:1]) and torch.equal(alone.token_ids, batch.token_ids[:1])
