"""DeepSeek-V4.1 decode steps are CUDA-graph safe: the padded static-buffer step that the runner captures
reads no device value on the host (checked by a dispatch mode that raises on every host read) and gives
the eager decode's logits; the batched decode two-level indexer picks what the per-request path picks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_core.backends import AttentionMetadata, supports_cuda_graphs
from deepinfer_core.models.deepseek_v41 import model as deepseek_v41
from deepinfer_core.models.deepseek_v41.compressor import two_level_topk_batched, two_level_topk_per_request
from deepinfer_core.worker.graphs import DecodeGraphs
from tests.models.v41_helpers import make_runner, random_prompt, tiny_checkpoint
from tests.oracle import FakeSeq, all_position_logprobs, step_plan

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
              aten.bincount.default, aten._unique2.default, aten.unique_consecutive.default,
              aten.unique_dim.default}


class HostReadError(RuntimeError):
    pass


class RaiseOnHostReads(TorchDispatchMode):
    """Inside it, every op that reads device values on the host or sizes its output from them raises
    `HostReadError`: `.item()` (and `bool()`/`int()` of a tensor), `nonzero`, boolean-mask indexing,
    `masked_select`, `bincount`, `unique`, `repeat_interleave` without `output_size`, and `Tensor.tolist`
    (patched while the mode is on: it reads memory without dispatching)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise HostReadError(f"{func} reads device values on the host")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise HostReadError("repeat_interleave without output_size reads its counts on the host")
        indexing = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default)
        if indexing and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            raise HostReadError(f"{func} with a boolean mask sizes its result on the host")
        return func(*args, **kwargs)

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        torch.Tensor.tolist = _raising_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def _raising_tolist(self):
    raise HostReadError("Tensor.tolist reads device values on the host")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def test_the_v41_model_declares_its_decode_graph_safe(checkpoint):
    model = make_runner(*checkpoint).model
    assert all(supports_cuda_graphs(b) for b in model.backends() if b not in model.moe_backends)
    assert deepseek_v41.HOST_ENGRAM_TABLES not in model.backends()
    for table in model.tables.values():  # Engram tables in host memory: their gather reads ids on the host
        table.placement = "host"
    assert deepseek_v41.HOST_ENGRAM_TABLES in model.backends()
    assert not all(supports_cuda_graphs(b) for b in model.backends())


def test_the_padded_decode_step_reads_nothing_on_the_host_and_equals_eager_decode(checkpoint):
    """Prompts of 5, 16, 21 and 34 tokens then 16 decode steps: ratio-2 groups close every other step,
    the ratio-1 candidate source outgrows its candidate pool (3 blocks of 2 entries), Engram looks back."""
    plain, padded = make_runner(*checkpoint), make_runner(*checkpoint)
    graphs = DecodeGraphs(padded.model, padded.kv_cache, padded.inputs,
                          max_batch=4, max_blocks=2, max_seq_len=256, sizes=[1, 2, 4])
    prompts = [random_prompt(n, seed=n) for n in (5, 16, 21, 34)]
    pairs = []
    for runner in (plain, padded):
        seqs = [FakeSeq(list(p), slot=i, block_table=[i]) for i, p in enumerate(prompts)]
        all_position_logprobs(runner, seqs, [len(p) for p in prompts])
        pairs.append(seqs)
    for step in range(16):
        live = 4 if step < 13 else 3  # the last steps: three requests, padded to the 4-row graph
        token = 7 + 31 * step
        for seqs in pairs:
            for s in seqs[:live]:
                s.token_ids.append(token)
        expected = torch.cat(all_position_logprobs(plain, pairs[0][:live], [1] * live))
        plan = step_plan(padded, pairs[1][:live], [1] * live)
        logits = _run_checked(graphs, plan, padded.update_states(plan))
        for s in pairs[1][:live]:
            s.num_computed_tokens += 1
        assert logits.shape[0] == live
        if live == 4:  # the graph's own size: the same kernels on the same rows, bit for bit
            assert torch.equal(logits.log_softmax(-1), expected), step
        else:  # a padding row changes the matmuls' row count, which may move the last bits on the CPU
            assert torch.equal(logits.argmax(-1), expected.argmax(-1)), step
            assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-5, step


def test_a_verification_step_of_two_tokens_a_request_reads_nothing_on_the_host(checkpoint):
    """Speculative decoding's k + 1-token steps run the same graph-safe path (width 2 here)."""
    plain, padded = make_runner(*checkpoint), make_runner(*checkpoint)
    graphs = DecodeGraphs(padded.model, padded.kv_cache, padded.inputs,
                          max_batch=4, max_blocks=2, max_seq_len=256, sizes=[4], widths=(1, 2))
    prompts = [random_prompt(n, seed=n) for n in (6, 15, 20)]  # three requests: one padding row
    pairs = []
    for runner in (plain, padded):
        seqs = [FakeSeq(list(p), slot=i, block_table=[i]) for i, p in enumerate(prompts)]
        all_position_logprobs(runner, seqs, [len(p) for p in prompts])
        pairs.append(seqs)
    for step in range(3):
        for seqs in pairs:
            for s in seqs:
                s.token_ids += [11 + step, 40 + step]
        expected = torch.cat(all_position_logprobs(plain, pairs[0], [2] * 3))
        plan = step_plan(padded, pairs[1], [2] * 3)
        states = padded.update_states(plan)
        logits = _run_checked(graphs, plan, states)
        for s in pairs[1]:
            s.num_computed_tokens += 2
        assert torch.equal(logits.argmax(-1), expected.argmax(-1)), step
        assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-5, step


def _run_checked(graphs, plan, states):
    """`graphs.run`, its padded static step (what a graph captures) inside `RaiseOnHostReads`."""
    forward = graphs._forward

    def checked(size, width):
        with RaiseOnHostReads():
            return forward(size, width)

    graphs._forward = checked
    try:
        return graphs.run(plan.requests, states)
    finally:
        graphs._forward = forward


def test_capture_goes_through_the_devices_graph_api(checkpoint):
    """The runner's capture path on a stand-in graph API: every size captured, a replay per step."""
    from contextlib import nullcontext

    from deepinfer_core.backends import GraphApi

    class Graph:
        replays = 0

        def pool(self):
            return None

        def replay(self):
            self.replays += 1

    class Stream:
        def wait_stream(self, other):
            pass

    api = GraphApi(Graph=Graph, graph=lambda g, pool=None: nullcontext(), Stream=Stream,
                   stream=lambda s: nullcontext(), current_stream=Stream, synchronize=lambda: None)
    runner = make_runner(*checkpoint)
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.inputs,
                          max_batch=2, max_blocks=1, max_seq_len=128, api=api)
    graphs.capture()
    assert sorted(graphs.graphs) == [(1, 1), (2, 1)]
    seqs = [FakeSeq(random_prompt(5), slot=0, block_table=[0]), FakeSeq(random_prompt(3), slot=1, block_table=[1])]
    all_position_logprobs(runner, seqs, [5, 3])
    for s in seqs:
        s.token_ids.append(9)
    plan = step_plan(runner, seqs, [1, 1])
    assert graphs.run(plan.requests, runner.update_states(plan)).shape[0] == 2
    assert graphs.graphs[2, 1][0].replays == 1


def test_the_host_read_check_catches_the_eager_prefill(checkpoint):
    runner = make_runner(*checkpoint)
    with pytest.raises(HostReadError), RaiseOnHostReads():  # the check is not vacuous: prefill reads counts
        all_position_logprobs(runner, [FakeSeq(random_prompt(9), slot=0, block_table=[0])], [9])


def decode_metadata(positions: list[int], tables: torch.Tensor) -> AttentionMetadata:
    n = len(positions)
    return AttentionMetadata(
        query_start_loc=torch.arange(n + 1), start_positions=torch.tensor(positions),
        positions=torch.tensor(positions), slots=torch.arange(n), block_tables=tables,
        query_lens=[1] * n, start_positions_host=list(positions), max_seq_len=256)


@pytest.mark.parametrize("ratio", [1, 2])
def test_batched_decode_picks_equal_the_per_request_picks(checkpoint, ratio):
    """Candidate source then a reindex layer inside its candidates, over positions from 0 (nothing
    visible) to past the candidate pool, with ReLU ties (negative head weights zero many scores)."""
    runner = make_runner(*checkpoint)
    config, plans = runner.model.config, runner.model.plans
    source = next(p for p in plans if p.is_candidate_source)
    inside = next(p for p in plans if p.uses_candidates)
    source, inside = (replace(p, attention=replace(p.attention, compress_rate=ratio)) for p in (source, inside))
    gen = torch.Generator().manual_seed(ratio)
    positions = [0, 1, 2, 9, 30, 77]
    n, heads, dim = len(positions), config.index_n_heads, config.index_head_dim
    tables = torch.tensor([[5, 1], [2, 7], [0, 3], [4, 6], [8, 9], [10, 11]])
    keys = torch.randn(12 * 128 // ratio + 1, dim, generator=gen)
    meta = decode_metadata(positions, tables)
    counts = (torch.tensor(positions) + 1) // ratio
    candidates = per_request = None
    for plan in (source, inside):
        q = torch.randn(n, heads, dim, generator=gen)
        weights = torch.randn(n, heads, generator=gen)
        batched, masks = two_level_topk_batched(q, weights, keys, meta, plan, config, candidates)
        each, lists = two_level_topk_per_request(q, weights, keys, meta, counts, plan, config,
                                                 per_request)
        assert torch.equal(batched, each), plan.index
        if plan.is_candidate_source:
            block = config.candidate_block_size
            for mask, short, count in zip(masks, lists, counts.tolist()):  # beyond: only future entries of kept blocks
                assert torch.equal(mask[None, :count], short) and not mask[-(-count // block) * block :].any()
            candidates, per_request = masks, lists
        assert (batched < counts[:, None]).all()  # no pick points at a future entry
