"""Rejected drafts leave no trace: run in lockstep with an engine that never drafts, a speculative
engine whose drafts are all rejected changes exactly the cache rows the other changes, to the same
values, and holds the same blocks (the rows its drafts wrote are restored bit for bit)."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.kv.blocks import kept_blocks
from deepinfer_core.models.layer_plan import BLOCK_SIZE
from deepinfer_core.speculative.rollback import (
    DraftRollback,
    DraftRows,
    RingTooSmallError,
    check_ring_sizes,
)
from tests.engine.test_spec_decode import (  # noqa: F401 (fixture)
    MIXED,
    VOCAB,
    generate,
    greedy_reference,
    make_engine,
    tokens,
)
from tests.models import v41_helpers


class WrongDrafter:
    """Drafts that are never the greedy token: the reference run's next tokens, shifted by one."""

    def __init__(self, reference: dict[str, list[int]], vocab_size: int = VOCAB) -> None:
        self.reference, self.vocab_size = reference, vocab_size

    def propose(self, seq, max_drafts):
        ahead = self.reference[seq.request_id][seq.num_output_tokens :][:max_drafts]
        return [(t + 1) % self.vocab_size for t in ahead], None


def cache_tensors(engine) -> list[torch.Tensor]:
    seen, out = set(), []
    for layer in engine.runner.kv_cache.layers:
        for name in ("window", "compressed", "kv_tail", "gate_tail", "index_keys", "index_kv_tail", "index_gate_tail",
                     "token_ids"):
            t = getattr(layer, name)
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def changed_rows(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(a != b).flatten(1 if a.dim() == 2 else 2).any(-1) for a, b in zip(before, after, strict=True)]


@pytest.mark.parametrize("k", [2, 5])
def test_rejected_drafts_leave_the_cache_as_a_run_that_never_drafted(tmp_path, greedy_reference, k):  # noqa: F811
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    plain = make_engine(tmp_path / "a", enable_prefix_caching=True)
    spec = make_engine(tmp_path / "b", {"method": "ngram", "num_speculative_tokens": k}, enable_prefix_caching=True)
    for engine in (plain, spec):
        for i, prompt in enumerate(MIXED):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    spec.speculator.drafter = WrongDrafter({key: v[0] for key, v in greedy_reference.items()})
    while plain.has_unfinished_requests():
        before_plain = [t.clone() for t in cache_tensors(plain)]
        before_spec = [t.clone() for t in cache_tensors(spec)]
        plain.step()
        spec.step()
        after_plain, after_spec = cache_tensors(plain), cache_tensors(spec)
        # the same rows changed (the drafts' rows were restored bit for bit), to the same values
        for a, b in zip(changed_rows(before_plain, after_plain), changed_rows(before_spec, after_spec), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(after_plain, after_spec, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert_same_bookkeeping(plain, spec)
    assert not spec.has_unfinished_requests()
    assert spec.stats()["spec_verified_tokens"] > 0 and spec.stats()["spec_accepted_tokens"] == 0


def test_rejected_drafts_leave_a_v41_cache_token_ids_included_as_a_run_that_never_drafted(tmp_path_factory):
    """V4.1 keeps paged token ids (Engram reads them back); under `deterministic` a step computes the same
    values whatever its batch, so the caches (ids, rings and pools) are equal bit for bit."""
    directory, weights = v41_helpers.tiny_checkpoint(tmp_path_factory)
    prompts = [v41_helpers.random_prompt(n, seed=i) for i, n in enumerate([3, 9, 26])]
    reference = tokens(generate(v41_helpers.make_engine(directory, weights, deterministic=True), prompts,
                                max_tokens=8, temperature=0))
    plain = v41_helpers.make_engine(directory, weights, deterministic=True)
    # k = 1 here; any k <= 16 fits the ratio-2 tail rings (`TAIL_RING_ROWS`, the k = 2..4 tests below)
    spec = v41_helpers.make_engine(directory, weights, deterministic=True,
                                   speculative_config={"method": "ngram", "num_speculative_tokens": 1,
                                                       "draft_length_policy": "fixed"})
    spec.speculator.drafter = WrongDrafter({key: v[0] for key, v in reference.items()}, spec.runner.config.vocab_size)
    for engine in (plain, spec):
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert any(layer.token_ids is not None for layer in spec.runner.kv_cache.layers)
    while plain.has_unfinished_requests():
        plain.step()
        spec.step()
        for a, b in zip(cache_tensors(plain), cache_tensors(spec), strict=True):
            assert torch.equal(a, b)
        assert_same_bookkeeping(plain, spec)
    assert not spec.has_unfinished_requests()
    assert spec.stats()["spec_verified_tokens"] > 0 and spec.stats()["spec_accepted_tokens"] == 0


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return make_engine(tmp_path_factory.mktemp("rollback"), {"method": "ngram", "num_speculative_tokens": 3}).runner


def test_capture_reads_each_kv_cache_stack_with_one_gather(runner):
    kv_cache = runner.kv_cache
    for i, layer in enumerate(kv_cache.layers):  # the stacks hold every layer's tensor of every field
        for f in fields(layer):
            tensor = getattr(layer, f.name)
            if tensor is not None:
                [row] = [s.tensor[j] for s in kv_cache.stacks if s.name == f.name
                         for j, holders in enumerate(s.layers) if i in holders]
                assert tensor.data_ptr() == row.data_ptr() and tensor.shape == row.shape
    drafts = [DraftRows(slot=0, start=14, num_drafts=3, block_table=[2])]  # 15 closes CSA and HCA windows
    saved = runner.spec.rollback.capture(drafts)  # the runner's rollback: every field has rows to save
    assert sorted((t.data_ptr(), t.numel()) for t, _ in saved.tensors) == sorted(
        (s.tensor.data_ptr(), s.tensor.numel()) for s in kv_cache.stacks)
    # a cache not built by `KVCache` (no stacks given): one gather per layer's tensor
    alone = DraftRollback(kv_cache.layers, runner.plans).capture(drafts)
    assert len(alone.tensors) == len(cache_tensors_of(runner)) > len(kv_cache.stacks)


@pytest.mark.parametrize("uses_stacks", [True, False])
def test_restore_puts_back_exactly_the_rows_of_rejected_positions(runner, uses_stacks):
    rollback = DraftRollback(runner.kv_cache.layers, runner.plans, runner.kv_cache.stacks if uses_stacks else ())
    # positions 15 16 17 (15 closes a CSA and an HCA window) with one draft accepted; 3 4 5 (3 closes a
    # CSA window) with none: the CSA pool saves an accepted and a rejected row
    drafts = [DraftRows(slot=0, start=14, num_drafts=3, block_table=[2]), DraftRows(2, 2, 3, [5])]
    rejected = [(0, 2, 16), (0, 2, 17), (2, 5, 3), (2, 5, 4), (2, 5, 5)]  # (slot, block, position)
    generator = torch.Generator().manual_seed(0)
    tensors = cache_tensors_of(runner)
    for tensor, _ in tensors:
        tensor.copy_(torch.rand(tensor.shape, generator=generator))
    before = [tensor.clone() for tensor, _ in tensors]
    saved = rollback.capture(drafts)
    for tensor, _ in tensors:  # the forward writes every row (more than drafts do: rows not saved stay)
        tensor.copy_(torch.rand(tensor.shape, generator=generator))
    expected = [tensor.clone() for tensor, _ in tensors]
    for (tensor, rate), old, new in zip(tensors, before, expected, strict=True):
        for slot, block, q in rejected:
            if rate is None:  # a slot ring
                new[slot, q % tensor.shape[1]] = old[slot, q % tensor.shape[1]]
            elif (q + 1) % rate == 0:
                row = block * (BLOCK_SIZE // rate) + (q + 1) // rate - 1
                new[row] = old[row]
    DraftRollback.restore(saved, [1, 0])
    for (tensor, _), want in zip(tensors, expected, strict=True):
        assert torch.equal(tensor, want)


def cache_tensors_of(runner) -> list[tuple[torch.Tensor, int | None]]:
    """Every cache tensor once, with its compress rate for paged pools (None for slot rings)."""
    seen, out = set(), []
    for layer, plan in zip(runner.kv_cache.layers, runner.plans, strict=True):
        for name in ("window", "kv_tail", "gate_tail", "index_kv_tail", "index_gate_tail", "compressed", "index_keys"):
            t = getattr(layer, name)
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append((t, plan.compress_rate if name in ("compressed", "index_keys") else None))
    return out


def assert_same_bookkeeping(plain, spec) -> None:
    a, b = plain.block_manager, spec.block_manager
    assert a.num_free_blocks == b.num_free_blocks and a.num_cached_blocks == b.num_cached_blocks
    assert list(a._free_uncached) == list(b._free_uncached)
    tables = {s.request_id: s.block_table for s in plain.scheduler.running}
    assert tables == {s.request_id: s.block_table for s in spec.scheduler.running}


def test_ring_sizes_bound_k():
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.models.layer_plan import build_layer_plan
    from tests.engine.test_spec_decode import CONFIG

    plans = build_layer_plan(ModelConfig.from_dict(CONFIG), torch.float32)
    check_ring_sizes(plans, 7)  # window 8 and CSA tails of 8 rows hold 8 positions
    with pytest.raises(RingTooSmallError, match="num_speculative_tokens <= 7"):
        check_ring_sizes(plans, 8)


def test_kept_blocks_returns_only_what_rejected_drafts_took():
    assert kept_blocks(3, 1, 256 + 5, 128) == 3  # the accepted tokens reach the new block
    assert kept_blocks(3, 1, 256, 128) == 2  # only drafts needed it
    assert kept_blocks(3, 0, 10, 128) == 3  # nothing new: nothing to give back


class MidBlockDrafter:
    """Drafts the reference continuation right for the first `j` slots and wrong after them, `j` cycling
    over 0..k with the request's steps: every acceptance length, rejections mid-block included."""

    def __init__(self, reference: dict[str, list[int]], vocab_size: int) -> None:
        self.reference, self.vocab_size, self.calls = reference, vocab_size, {}

    def propose(self, seq, max_drafts):
        ahead = self.reference[seq.request_id][seq.num_output_tokens :][:max_drafts]
        calls = self.calls[seq.request_id] = self.calls.get(seq.request_id, 0) + 1
        right = calls % (max_drafts + 1)
        return [t if i < right else (t + 1) % self.vocab_size for i, t in enumerate(ahead)], None


def v41_outputs(outputs) -> dict[str, tuple[list[int], list[float]]]:
    return {out.request_id: (out.outputs[0].token_ids, [next(iter(p.values())).logprob if len(p) == 1 else
                                                        p[t].logprob for t, p in zip(out.outputs[0].token_ids,
                                                                                     out.outputs[0].logprobs)])
            for out in outputs}


@pytest.mark.parametrize("k", [2, 3, 4])
def test_v41_drafts_rejected_mid_block_leave_greedy_tokens_and_logprobs_bitwise_equal(tmp_path_factory, k):
    """V4.1's ratio-2 compressor rings hold a verification step's k + 1 positions (`TAIL_RING_ROWS`), so any
    k rolls back exactly: under `deterministic` the tokens and logprobs equal those of no speculation bit
    for bit, whichever slot the first rejected draft sits at (a prompt closing a group and one leaving it open)."""
    directory, weights = v41_helpers.tiny_checkpoint(tmp_path_factory)
    prompts = [v41_helpers.random_prompt(n, seed=i) for i, n in enumerate([4, 9])]
    plain = v41_outputs(v41_helpers.run(v41_helpers.make_engine(directory, weights, deterministic=True), prompts, 12))
    spec = v41_helpers.make_engine(directory, weights, deterministic=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": k, "draft_length_policy": "fixed"})
    spec.speculator.drafter = MidBlockDrafter({key: v[0] for key, v in plain.items()}, spec.runner.config.vocab_size)
    drafted = v41_outputs(v41_helpers.run(spec, prompts, 12))
    assert drafted == plain
    histogram = spec.stats()["spec_acceptance_histogram"]
    assert len(histogram) >= 3 and histogram[0] and histogram[1] and histogram[2]  # rejections mid-block


def test_v41_speculation_at_k_4_matches_default_mode_decode_within_1e_5(tmp_path_factory):
    """Default (non-deterministic) mode: the same greedy tokens, logprobs within 1e-5."""
    directory, weights = v41_helpers.tiny_checkpoint(tmp_path_factory)
    prompts = [v41_helpers.random_prompt(n, seed=i) for i, n in enumerate([5, 17])]
    plain = v41_outputs(v41_helpers.run(v41_helpers.make_engine(directory, weights), prompts, 10))
    spec = v41_helpers.make_engine(directory, weights, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "draft_length_policy": "fixed"})
    spec.speculator.drafter = MidBlockDrafter({key: v[0] for key, v in plain.items()}, spec.runner.config.vocab_size)
    drafted = v41_outputs(v41_helpers.run(spec, prompts, 10))
    for key, (ids, logprobs) in plain.items():
        assert drafted[key][0] == ids
        torch.testing.assert_close(torch.tensor(drafted[key][1]), torch.tensor(logprobs), atol=1e-5, rtol=0)
    assert spec.stats()["spec_accepted_tokens"] > 0
