"""The padded static-buffer decode step that CUDA graphs capture, run eagerly on the CPU."""

from __future__ import annotations

import torch

from deepinfer_core.plan import PENDING_TOKEN
from deepinfer_core.worker.graphs import (
    NO_WRITE,
    DecodeGraphs,
    SlotBlockTables,
    batch_ladder,
    capture_sizes,
)
from deepinfer_core.worker.input_batch import CarriedTokens
from tests.models.test_v41_decode_graphs import RaiseOnHostReads
from tests.oracle import (
    FakeSeq,
    all_position_logprobs,
    make_runner,
    parity_config,
    random_state_dict,
    step_plan,
)

CONFIG = parity_config("sliding_csa_hca")
WEIGHTS = random_state_dict(CONFIG, seed=5)


def test_batch_ladder_covers_every_size():
    for max_batch in (1, 3, 16, 40, 256):
        ladder = batch_ladder(max_batch)
        assert ladder[-1] == max_batch and ladder == sorted(set(ladder))
        assert all(any(size >= n for size in ladder) for n in range(1, max_batch + 1))


def test_capture_sizes_follow_vllms_cuda_graph_sizes_rule():
    assert batch_ladder(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert capture_sizes(256, None) == batch_ladder(256)
    assert capture_sizes(256, [40]) == [1, 2, 4, 8, 16, 24, 32, 40]  # one value: the ladder up to it
    assert capture_sizes(16, [512]) == batch_ladder(16)  # never above max_num_seqs
    assert capture_sizes(64, [8, 1, 32, 100]) == [1, 8, 32]  # several: exactly those that fit


def test_padded_decode_equals_plain_decode(tmp_path):
    plain, padded = make_runner(tmp_path, CONFIG, WEIGHTS), make_runner(tmp_path, CONFIG, WEIGHTS)
    graphs = DecodeGraphs(padded.model, padded.kv_cache, padded.inputs,
                          max_batch=6, max_blocks=4, max_seq_len=512)
    prompts = [list(range(2, 2 + n)) for n in (3, 15, 16, 70)]  # windows close at different steps
    pairs = []
    for runner in (plain, padded):
        seqs = [FakeSeq(list(p), slot=i, block_table=[i]) for i, p in enumerate(prompts)]
        all_position_logprobs(runner, seqs, [len(p) for p in prompts])
        pairs.append(seqs)
    for i, s in enumerate(pairs[1]):
        s.request_id = f"r{i}"
    for step in range(20):  # crosses CSA (4) and HCA (16) window closes for every request
        token = 5 + step
        for s in pairs[0]:
            s.token_ids.append(token)
        expected = torch.cat(all_position_logprobs(plain, pairs[0], [1] * 4))
        seqs = pairs[1]
        carried = None
        if step % 2:  # odd steps: the token is still "on the device", in another step's row order
            carried = CarriedTokens(torch.tensor([0, token, 0, token, token, token]), ["x", "r0", "y", "r2", "r3", "r1"])
            token = PENDING_TOKEN
        for s in seqs:
            s.token_ids.append(token)
        plan = step_plan(padded, seqs, [1] * 4)
        logits = graphs.run(plan.requests, padded.update_states(plan), carried)
        for s in seqs:
            s.num_computed_tokens += 1
        assert logits.shape[0] == 4  # padded to a ladder size of 4 here, padding rows dropped
        assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-5, step
    for a, b in zip(plain.kv_cache.layers, padded.kv_cache.layers):
        torch.testing.assert_close(a.window[:4], b.window[:4], rtol=0, atol=1e-5)
        if a.compressed is not None:  # real blocks only: the scratch block and row may differ
            rows = 4 * (a.compressed.shape[0] - 1) // (plain.num_blocks + 2)
            assert torch.allclose(a.compressed[:rows], b.compressed[:rows], atol=1e-6)


def expected_rows(tables: SlotBlockTables, owners: dict[int, list[int]]) -> torch.Tensor:
    rows = torch.zeros_like(tables.tables)
    rows[-1] = tables.tables[-1]
    for slot, table in owners.items():
        rows[slot, : len(table)] = torch.tensor(table)
    return rows


def test_slot_block_tables_follow_appends_new_owners_and_shrinking_rows():
    tables = SlotBlockTables(num_slots=3, max_blocks=5, scratch_block=9, device=torch.device("cpu"))
    a, b = FakeSeq([1], slot=0, block_table=[4, 2]), FakeSeq([1], slot=2, block_table=[7])
    tables.sync([a, b])
    assert torch.equal(tables.tables, expected_rows(tables, {0: [4, 2], 2: [7]}))
    assert tables.tables[3].tolist() == [9] * 5  # the scratch slot's row, for padding rows
    a.block_table.append(3)  # a decode crossed into a new block: only that id is sent
    a.block_table.append(8)
    tables.sync([a, b])
    assert torch.equal(tables.tables, expected_rows(tables, {0: [4, 2, 3, 8], 2: [7]}))
    c = FakeSeq([1], slot=0, block_table=[6])  # slot 0 reused by a shorter table: the rest is zeroed
    tables.sync([b, c])
    assert torch.equal(tables.tables, expected_rows(tables, {0: [6], 2: [7]}))
    c.block_table = [1, 5]  # the list replaced (a prefix match): the row is rewritten
    tables.sync([c])
    assert torch.equal(tables.tables, expected_rows(tables, {0: [1, 5], 2: [7]}))
    out = torch.empty(2, 5, dtype=torch.long)
    tables.gather(torch.tensor([2, 0]), out)
    assert out.tolist() == [[7, 0, 0, 0, 0], [1, 5, 0, 0, 0]]


def test_slot_block_tables_reject_a_table_wider_than_the_graphs():
    tables = SlotBlockTables(num_slots=2, max_blocks=2, scratch_block=9, device=torch.device("cpu"))
    try:
        tables.sync([FakeSeq([1], slot=0, block_table=[1, 2, 3])])
    except ValueError as err:
        assert "3 blocks" in str(err)
    else:
        raise AssertionError("a 3-block table fitted a 2-block graph row")


def test_graph_inputs_hold_the_real_rows_then_padding(tmp_path):
    runner = make_runner(tmp_path, CONFIG, WEIGHTS)
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.inputs,
                          max_batch=6, max_blocks=3, max_seq_len=512)
    seqs = [FakeSeq([3, 4, 5], slot=5, block_table=[2], num_computed_tokens=2, replay_start=1, no_write_before=2),
            FakeSeq([6, 7], slot=1, block_table=[0, 1], num_computed_tokens=1),
            FakeSeq([8], slot=3, block_table=[4])]
    def run(seqs):
        plan = step_plan(runner, seqs, [1] * len(seqs))
        graphs.run(plan.requests, runner.update_states(plan))

    run(seqs + [FakeSeq([9], slot=0, block_table=[6])])  # 4 rows, then 3 padded to 4 over a stale row
    run(seqs)
    cache = runner.kv_cache
    assert graphs.input_ids[:4].tolist() == [5, 7, 8, 0]
    assert graphs.positions[:4].tolist() == [2, 1, 0, 0]
    assert graphs.slots[:4].tolist() == [5, 1, 3, cache.scratch_slot]
    assert graphs.no_write_before[:4].tolist() == [2, 0, 0, NO_WRITE]
    assert graphs.window_starts[:4].tolist() == [1, 0, 0, 0]
    assert graphs.block_tables[:4].tolist() == [[2, 0, 0], [0, 1, 0], [4, 0, 0], [cache.scratch_block] * 3]


def test_capture_and_replay_go_through_the_devices_graph_api(tmp_path):
    from contextlib import nullcontext

    from deepinfer_core.backends import GraphApi

    calls = []

    class Graph:
        def __init__(self):
            self.replays = 0

        def pool(self):
            return ("pool", id(self))

        def replay(self):
            self.replays += 1

    class Stream:
        def wait_stream(self, other):
            calls.append("wait")

    def graph(g, pool=None):
        calls.append(("capture", pool))
        return nullcontext()

    api = GraphApi(Graph=Graph, graph=graph, Stream=Stream, stream=lambda s: nullcontext(),
                   current_stream=Stream, synchronize=lambda: calls.append("sync"))
    runner = make_runner(tmp_path, CONFIG, WEIGHTS)
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.inputs,
                          max_batch=3, max_blocks=2, max_seq_len=256, api=api, widths=(1, 3))
    graphs.capture()
    assert graphs.sizes == [1, 2, 3] and calls[-1] == "sync"
    assert sorted(graphs.graphs) == [(s, w) for s in (1, 2, 3) for w in (1, 3)]  # every size, both widths
    pools = [c[1] for c in calls if isinstance(c, tuple)]
    assert pools[0] is None and pools[1] == graphs.graphs[3, 3][0].pool()  # the most tokens first, then its pool
    seqs = [FakeSeq([3, 4], slot=0, block_table=[0], num_computed_tokens=1),
            FakeSeq([5], slot=1, block_table=[1])]
    plan = step_plan(runner, seqs, [1, 1])
    logits = graphs.run(plan.requests, runner.update_states(plan))
    assert graphs.graphs[2, 1][0].replays == 1 and logits.shape[0] == 2  # replayed the size-2 decode graph
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.token_ids += [6, 7, 8]
    plan = step_plan(runner, seqs, [3, 3])
    logits = graphs.run(plan.requests, runner.update_states(plan))
    assert graphs.graphs[2, 3][0].replays == 1 and logits.shape[0] == 6  # three tokens a request
    assert not graphs.can_run(2, 2) and graphs.can_run(3, 3) and not graphs.can_run(4, 1)


def test_padded_multi_token_steps_equal_eager_steps(tmp_path):
    """Steps of three tokens a request (a verification step's shape) through the padded static buffers
    give the logits and cache of the eager step computing the same tokens."""
    plain, padded = make_runner(tmp_path, CONFIG, WEIGHTS), make_runner(tmp_path, CONFIG, WEIGHTS)
    graphs = DecodeGraphs(padded.model, padded.kv_cache, padded.inputs,
                          max_batch=6, max_blocks=4, max_seq_len=512, widths=(1, 3))
    forward = graphs._forward

    def checked_forward(size, width):  # what a CUDA graph captures may not read device values on the host
        with RaiseOnHostReads():
            return forward(size, width)

    graphs._forward = checked_forward
    prompts = [list(range(2, 2 + n)) for n in (3, 14, 16)]  # windows close at different tokens of a step
    pairs = []
    for runner in (plain, padded):
        seqs = [FakeSeq(list(p), slot=i, block_table=[i]) for i, p in enumerate(prompts)]
        all_position_logprobs(runner, seqs, [len(p) for p in prompts])
        pairs.append(seqs)
    for step in range(8):  # 24 positions: CSA (4), HCA (16) and window (8) boundaries inside steps
        new = [5 + step, 40 + step, 70 - step]
        for seqs in pairs:
            for s in seqs:
                s.token_ids += new
        expected = torch.cat(all_position_logprobs(plain, pairs[0], [3] * 3))
        carried = None
        if step % 2:  # a pending first token, read from the last step's device copy
            carried = CarriedTokens(torch.tensor([new[0]] * 3), [s.request_id for s in pairs[1]])
            for s in pairs[1]:
                s.token_ids[-3] = PENDING_TOKEN
        plan = step_plan(padded, pairs[1], [3] * 3)
        logits = graphs.run(plan.requests, padded.update_states(plan), carried)
        for s in pairs[1]:
            s.num_computed_tokens += 3
            if step % 2:
                s.token_ids[-3] = new[0]
        assert logits.shape[0] == 9  # 3 requests padded to a ladder size of 4, padding rows dropped
        assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-5, step
    for a, b in zip(plain.kv_cache.layers, padded.kv_cache.layers):
        torch.testing.assert_close(a.window[:3], b.window[:3], rtol=0, atol=1e-5)
        if a.compressed is not None:  # real blocks only: the scratch block and row may differ
            rows = 3 * (a.compressed.shape[0] - 1) // (plain.num_blocks + 2)
            assert torch.allclose(a.compressed[:rows], b.compressed[:rows], atol=1e-6)
