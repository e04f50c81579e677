"""The MTP layer's passes through `MTPGraphs`: on the CPU the graphs' padded static-input passes run
eagerly (`api` None), so these tests check everything a replay depends on but the capture itself
(the NVIDIA plugin's GPU run captures them). A pass replays when every request feeds the layer the same
number of rows; it must then draft exactly what the eager pass drafts, and leave the MTP cache's real
slots as the eager pass leaves them (padding rows write only the scratch slot; on the CPU a padded
batch's GEMMs may round the last bit differently, so the cache is compared to fp32 rounding)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.speculative.mtp_graphs import MTPGraphs
from tests.engine.test_spec_decode import MIXED, generate, tokens
from tests.engine.test_spec_mtp import echo_weights, make_engine

K = 3


def with_graphs(engine, sizes=(1, 2, 4)):
    """`engine`'s MTP drafter with the graphs' padded passes (eager on the CPU); counts their runs by width."""
    runner = engine.runner
    runner.mtp.capture_graphs(None, list(sizes), engine.config.max_model_len)
    widths = []
    run = runner.mtp.graphs.run

    def counted(slots, starts, windows, width, ids, prev, heads=None):
        widths.append((len(slots), width))
        return run(slots, starts, windows, width, ids, prev, heads)

    runner.mtp.graphs.run = counted
    return widths


def record_proposals(engine):
    """Every `propose` result of `engine`'s MTP drafter, in order."""
    proposals = []
    propose = engine.runner.mtp.propose

    def recorded(*args):
        out = propose(*args)
        proposals.append(out)
        return out

    engine.runner.mtp.propose = recorded
    return proposals


def mtp_cache(engine) -> dict[str, torch.Tensor]:
    """The MTP cache's tensors, its real slots only (the scratch slot is the padding rows')."""
    cache, num_slots = engine.runner.mtp.cache[0], engine.runner.num_slots
    return {name: t[:num_slots].clone() for name, t in vars(cache).items() if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("weights", ["echo", "random"])
def test_replayed_passes_draft_what_eager_passes_draft(tmp_path, weights):
    """Echo weights (every draft accepted: every request feeds k + 1 rows, deeper drafts one) and random
    ones (drafts rejected: one row, or unequal counts that run eagerly), prompts of mixed lengths
    (prefill chunks in the passes, which run eagerly): the same proposals, confidences and tokens, and
    the same MTP cache, with and without the graphs' passes."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    options = {"weights": echo_weights()} if weights == "echo" else {}
    spec = {"method": "mtp", "num_speculative_tokens": K}
    eager, graphed = make_engine(tmp_path / "a", spec, **options), make_engine(tmp_path / "b", spec, **options)
    widths = with_graphs(graphed)
    want, got = record_proposals(eager), record_proposals(graphed)
    out_eager = tokens(generate(eager, MIXED, temperature=0))
    assert tokens(generate(graphed, MIXED, temperature=0)) == out_eager
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert [d for d, _ in a] == [d for d, _ in b]
            for (_, ca), (_, cb) in zip(a, b, strict=True):
                assert ca == pytest.approx(cb, rel=1e-5, abs=1e-6)
    for name, tensor in mtp_cache(eager).items():  # padded GEMMs round a last bit differently on the CPU
        torch.testing.assert_close(mtp_cache(graphed)[name], tensor, rtol=1e-5, atol=1e-5, msg=name)
    assert any(width == 1 for _, width in widths)  # deeper drafts replayed
    # every request verified k drafts: the first pass feeds k + 1 rows a request, whatever each accepted
    assert any(width == K + 1 for _, width in widths)


def test_seeded_sampling_and_a_batch_padded_to_a_captured_size(tmp_path):
    """Seeded sampling with three requests (padded to four rows of the scratch slot): the same tokens as
    without speculation, the drafts drawn with the target's noise, so with echo weights all accepted."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    weights = echo_weights()
    prompts = MIXED[:3]
    want = tokens(generate(make_engine(tmp_path / "a", weights=weights), prompts, temperature=0.8, seed=3))
    engine = make_engine(tmp_path / "b", {"method": "mtp", "num_speculative_tokens": K}, weights=weights)
    widths = with_graphs(engine, sizes=(2, 4))
    assert tokens(generate(engine, prompts, temperature=0.8, seed=3)) == want
    assert (3, 1) in widths and (3, K + 1) in widths
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_verified_tokens"] > 0


def test_graph_shapes_and_padding_rows(tmp_path):
    """Widths 1 .. k + 1 at the decode graphs' sizes; three requests run in the graph of four, whose
    fourth row is the scratch slot's."""
    engine = make_engine(tmp_path, {"method": "mtp", "num_speculative_tokens": K})
    widths = with_graphs(engine, sizes=(2, 4))
    graphs: MTPGraphs = engine.runner.mtp.graphs
    assert graphs.widths == list(range(1, K + 2)) and graphs.sizes == [2, 4]
    assert graphs.can_run(3, K + 1) and not graphs.can_run(5, 1) and not graphs.can_run(2, K + 2)
    generate(engine, MIXED[:3], temperature=0)
    assert widths[-1][0] == 3 and graphs.slots[3].item() == engine.runner.num_slots
