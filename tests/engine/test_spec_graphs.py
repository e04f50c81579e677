"""Speculative decoding through the decode-graph path (`DecodeGraphs` with a width of k + 1 tokens a
request), run eagerly on the CPU with its static padded buffers: the output equals decoding without
speculation, verification steps and the MTP drafter included, and those steps did take that path."""

from __future__ import annotations

import pytest

from deepinfer_core.models.layer_plan import BLOCK_SIZE
from deepinfer_core.worker.graphs import DecodeGraphs
from tests.engine.test_spec_decode import MIXED, ScriptedDrafter, generate, make_engine, tokens
from tests.engine.test_spec_mtp import WEIGHTS as MTP_WEIGHTS
from tests.engine.test_spec_mtp import make_engine as make_mtp_engine


@pytest.fixture(scope="module")
def greedy_reference(tmp_path_factory):
    return tokens(generate(make_engine(tmp_path_factory.mktemp("ref")), MIXED, temperature=0))


def use_graphs(engine, k: int) -> list[tuple[int, int]]:
    """Give the engine's runner decode graphs of widths 1 and k + 1 (eager replays on the CPU); the
    returned list fills with the (batch size, width) of every step that ran through them."""
    runner = engine.runner
    max_len = runner.engine_config.max_model_len
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.inputs,
                          runner.num_slots, -(-max_len // BLOCK_SIZE), max_len, widths=(1, k + 1))
    shapes, forward = [], graphs._forward

    def recorded(size, width):
        shapes.append((size, width))
        return forward(size, width)

    graphs._forward = recorded
    runner.graphs = graphs
    return shapes


def scripted(reference, offset):
    return ScriptedDrafter({str(i): v[0] for i, v in enumerate(reference.values())}, offset)


def test_verification_steps_replay_graphs_and_change_nothing(tmp_path, greedy_reference):
    for offset in (0, 1):  # every draft accepted, then every draft rejected (rolled back)
        (tmp_path / str(offset)).mkdir()
        engine = make_engine(tmp_path / str(offset), {"method": "ngram", "num_speculative_tokens": 3})
        engine.speculator.drafter = scripted(greedy_reference, offset)
        shapes = use_graphs(engine, 3)
        assert tokens(generate(engine, MIXED, temperature=0)) == greedy_reference
        assert (4, 4) in shapes  # three requests with three drafts each, padded to a batch of four
        stats = engine.stats()
        assert (stats["spec_accepted_tokens"] > 0) == (offset == 0) and stats["spec_verified_tokens"] > 0
        assert engine.block_manager.num_free_blocks == engine.executor.info.num_blocks


def test_seeded_sampling_through_verification_graphs(tmp_path):
    params = {"temperature": 0.8, "top_k": 50, "seed": 7}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    reference = generate(make_engine(tmp_path / "a"), MIXED, **params)
    engine = make_engine(tmp_path / "b", {"method": "ngram", "num_speculative_tokens": 2})
    engine.speculator.drafter = ScriptedDrafter({k: v.outputs[0].token_ids for k, v in reference.items()}, 0)
    shapes = use_graphs(engine, 2)
    assert tokens(generate(engine, MIXED, **params)) == tokens(reference)
    assert any(width == 3 for _, width in shapes)


def test_mtp_drafting_reads_the_streams_of_graph_steps(tmp_path, greedy_reference):
    engine = make_mtp_engine(tmp_path, {"method": "mtp", "num_speculative_tokens": 2}, weights=MTP_WEIGHTS)
    shapes = use_graphs(engine, 2)
    assert tokens(generate(engine, MIXED, temperature=0)) == greedy_reference
    assert {width for _, width in shapes} >= {3}  # verification steps ran through the graph path
    assert engine.stats()["spec_verify_steps"] > 0
