"""Rejected drafts leave no trace: run in lockstep with an engine that never drafts, a speculative
engine whose drafts are all rejected changes exactly the cache rows the other changes, to the same
values, and holds the same blocks (the rows its drafts wrote are restored bit for bit)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.engine.spec.rollback import (
    DraftRollback,
    DraftRows,
    RingTooSmallError,
    check_ring_sizes,
    kept_blocks,
)
from deepinfer_core.models.layer_plan import BLOCK_SIZE
from tests.engine.test_spec_decode import MIXED, VOCAB, greedy_reference, make_engine  # noqa: F401 (fixture)


class WrongDrafter:
    """Drafts that are never the greedy token: the reference run's next tokens, shifted by one."""

    def __init__(self, reference: dict[str, list[int]]) -> None:
        self.reference = reference

    def propose(self, seq, max_drafts):
        ahead = self.reference[seq.request_id][seq.num_output_tokens :][:max_drafts]
        return [(t + 1) % VOCAB for t in ahead], None


def cache_tensors(engine) -> list[torch.Tensor]:
    seen, out = set(), []
    for layer in engine.runner.kv_cache.layers:
        for name in ("window", "compressed", "kv_tail", "gate_tail", "index_keys", "index_kv_tail", "index_gate_tail"):
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


def test_restore_puts_back_exactly_the_rows_of_rejected_positions(tmp_path):
    runner = make_engine(tmp_path, {"method": "ngram", "num_speculative_tokens": 3}).runner
    rollback = DraftRollback(runner.kv_cache.layers, runner.plans)
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
