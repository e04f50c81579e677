"""ReferenceVerifier: greedy prefix acceptance and distribution-preserving rejection sampling."""

import pytest
import torch

from deepinfer_core.backends.verify import VerifyBackend, VerifySpec
from deepinfer_core.reference.verify import ReferenceVerifier

VOCAB = 5


@pytest.fixture
def verifier():
    return ReferenceVerifier(VerifySpec(vocab_size=VOCAB, max_draft_tokens=3), torch.device("cpu"))


def one_hot_logits(token_rows):
    """Target logits whose argmax at each position is the given token."""
    tokens = torch.tensor(token_rows)
    return torch.nn.functional.one_hot(tokens, VOCAB).float() * 5


def test_satisfies_the_protocol(verifier):
    assert isinstance(verifier, VerifyBackend)


def test_greedy_accepts_the_matching_prefix_then_the_target_token(verifier):
    target = one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 0], [0, 2, 3], [1, 2, 3]])
    out = verifier.verify(drafts, None, target, torch.zeros(3))
    assert out.num_accepted.tolist() == [2, 0, 3]
    assert out.token_ids.tolist() == [[1, 2, 3, -1], [1, -1, -1, -1], [1, 2, 3, 4]]


def test_a_match_after_a_mismatch_is_not_accepted(verifier):
    target = one_hot_logits([[1, 2, 3, 4]])
    out = verifier.verify(torch.tensor([[1, 0, 3]]), None, target, torch.zeros(1))
    assert out.num_accepted.tolist() == [1]
    assert out.token_ids.tolist() == [[1, 2, -1, -1]]


def test_no_drafts_emits_one_target_token(verifier):
    target = one_hot_logits([[3], [4]])
    out = verifier.verify(torch.zeros(2, 0, dtype=torch.int64), None, target, torch.zeros(2))
    assert out.num_accepted.tolist() == [0, 0] and out.token_ids.tolist() == [[3], [4]]


def test_rejects_misshaped_inputs(verifier):
    drafts = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_logits"):
        verifier.verify(drafts, None, torch.zeros(2, 2, VOCAB), torch.zeros(2))
    with pytest.raises(ValueError, match="draft_probs"):
        verifier.verify(drafts, torch.zeros(2, 2, VOCAB + 1), torch.zeros(2, 3, VOCAB), torch.zeros(2))
    with pytest.raises(ValueError, match="max_draft_tokens"):
        verifier.verify(torch.zeros(2, 4, dtype=torch.int64), None, torch.zeros(2, 5, VOCAB), torch.zeros(2))


def frequencies(token_ids):
    return torch.bincount(token_ids, minlength=VOCAB).double() / token_ids.numel()


def assert_close_to(observed_tokens, expected):
    observed = frequencies(observed_tokens)
    tolerance = 5 * (expected * (1 - expected) / observed_tokens.numel()).sqrt() + 1e-3
    assert ((observed - expected).abs() < tolerance).all(), (observed, expected)


def test_rejection_sampling_preserves_the_target_distribution(verifier):
    num_rows, temperature = 40000, 0.8
    generator = torch.Generator().manual_seed(0)
    target_logits = torch.tensor(
        [[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 1.5, 0.2, -0.5], [1.0, -1.0, 0.0, 2.0, 0.0]]
    )
    draft_probs = torch.tensor([[0.1, 0.5, 0.2, 0.1, 0.1], [0.3, 0.3, 0.1, 0.2, 0.1]], dtype=torch.float64)
    drafts = torch.stack(
        [torch.multinomial(q, num_rows, replacement=True, generator=generator) for q in draft_probs], 1
    )
    out = verifier.verify(
        drafts,
        draft_probs.float().expand(num_rows, -1, -1),
        target_logits.expand(num_rows, -1, -1),
        torch.full((num_rows,), temperature),
        generator=generator,
    )
    target = torch.softmax(target_logits.double() / temperature, dim=-1)
    assert_close_to(out.token_ids[:, 0], target[0])
    # Given the first draft was accepted, the second emitted token follows the second target row,
    # and the bonus after two accepted drafts follows the third.
    assert_close_to(out.token_ids[out.num_accepted >= 1, 1], target[1])
    assert_close_to(out.token_ids[out.num_accepted == 2, 2], target[2])
    expected_acceptance = torch.minimum(target[0], draft_probs[0]).sum()
    assert abs((out.num_accepted >= 1).double().mean() - expected_acceptance) < 0.01
    valid = torch.arange(3)[None, :] <= out.num_accepted[:, None]
    assert ((out.token_ids >= 0) == valid).all()


def test_greedy_drafts_without_probs_still_give_the_target_distribution(verifier):
    num_rows = 40000
    target_logits = torch.tensor([[0.5, 1.5, 0.0, -0.5, 0.2]])
    drafts = torch.ones(num_rows, 1, dtype=torch.int64)
    out = verifier.verify(
        drafts,
        None,
        target_logits.expand(num_rows, 2, -1).contiguous(),
        torch.ones(num_rows),
        generator=torch.Generator().manual_seed(1),
    )
    target = torch.softmax(target_logits[0].double(), dim=-1)
    assert_close_to(out.token_ids[:, 0], target)
    assert abs((out.num_accepted == 1).double().mean() - target[1]) < 0.01


def test_greedy_and_sampled_rows_mix(verifier):
    target = one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4]]) * 10  # sampled row is near-deterministic too
    drafts = torch.tensor([[1, 2, 0], [1, 2, 3]])
    out = verifier.verify(
        drafts, None, target, torch.tensor([0.0, 1.0]), generator=torch.Generator().manual_seed(0)
    )
    assert out.token_ids.tolist() == [[1, 2, 3, -1], [1, 2, 3, 4]]
    assert out.num_accepted.tolist() == [2, 3]
